// compile_fail/needs_cpp20.cpp: pdo compiled as C++17: one message that says which standard it needs,
// not the headers' own failures.
// std: c++17
// expect: pdo: needs C\+\+20: compile with -std=c\+\+20
#include <pdo/pdo.hpp>

int main() { return 0; }

// tests/catch_main.cpp: the Catch2 main shared by the unit tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

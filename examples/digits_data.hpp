// examples/digits_data.hpp: the handwritten digits set that scikit-learn ships
// (digits.csv.gz: 1797 rows of 64 pixel values in 0..16 and a label in 0..9).
#pragma once

#include <pdo/pdo.hpp>

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace digits {

struct dataset {
  pdo::tensor<float, 4> images;  ///< [n, 1, 8, 8], pixels scaled to [0, 1]
  pdo::tensor<int, 1> labels;    ///< [n]
};

/// @brief Where digits.csv.gz may be: `explicit_path` if given, $PDO_DIGITS, the Python
/// packages of the system, or where python3's scikit-learn says it is.
inline std::vector<std::string> candidates(const std::string& explicit_path) {
  if (!explicit_path.empty()) return {explicit_path};
  std::vector<std::string> paths;
  if (const char* env = std::getenv("PDO_DIGITS"); env != nullptr && *env != '\0') paths.emplace_back(env);
  const std::string tail = "sklearn/datasets/data/digits.csv.gz";
  for (const char* root : {"/usr/lib/python3/dist-packages/", "/usr/local/lib/python3/dist-packages/"}) paths.push_back(root + tail);
  std::error_code ec;
  for (const char* base : {"/usr/lib", "/usr/local/lib"})
    for (const auto& entry : std::filesystem::directory_iterator(base, ec))
      if (entry.path().filename().string().rfind("python3.", 0) == 0)
        for (const char* sub : {"/dist-packages/", "/site-packages/"}) paths.push_back(entry.path().string() + sub + tail);
  if (FILE* pipe = popen("python3 -c \"import os, sklearn.datasets as d; print(os.path.join(os.path.dirname(d.__file__), "
                         "'data', 'digits.csv.gz'))\" 2>/dev/null",
                         "r")) {
    char line[4096] = {};
    if (std::fgets(line, sizeof line, pipe) != nullptr) {
      std::string p(line);
      while (!p.empty() && (p.back() == '\n' || p.back() == '\r')) p.pop_back();
      if (!p.empty()) paths.push_back(p);
    }
    pclose(pipe);
  }
  return paths;
}

/// @brief The whole decompressed content of `path` (plain text is read as it is); a
/// pdo::io_error naming the file for a truncated or corrupt gzip stream.
inline std::string read_all(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) throw pdo::io_error("digits: cannot open " + path);
  std::string text;
  char chunk[1 << 16];
  for (;;) {
    const int got = gzread(file.get(), chunk, sizeof chunk);
    if (got < 0) break;
    text.append(chunk, static_cast<std::size_t>(got));
    if (got < static_cast<int>(sizeof chunk)) break;
  }
  int err = Z_OK;
  const char* message = gzerror(file.get(), &err);
  if (err != Z_OK && err != Z_STREAM_END)
    throw pdo::io_error("digits: " + path + ": truncated or corrupt gzip data (" + message + "); download or reinstall the file");
  return text;
}

/// @brief Reads the set; pdo::io_error when the file is missing, unreadable, truncated or
/// malformed (with the line and what is wrong).
inline dataset load(const std::string& explicit_path = "") {
  std::string path;
  std::string tried;
  for (const auto& p : candidates(explicit_path)) {
    if (std::filesystem::is_regular_file(p)) {
      path = p;
      break;
    }
    tried += "\n  " + p;
  }
  if (path.empty())
    throw pdo::io_error("digits: digits.csv.gz not found; install scikit-learn (apt-get install python3-sklearn, or pip install "
                        "scikit-learn), or pass --data PATH. Looked in:" + tried);
  const std::string content = read_all(path);
  std::vector<float> pixels;
  std::vector<int> labels;
  std::size_t line = 0;
  for (std::size_t start = 0; start < content.size();) {
    const std::size_t stop = std::min(content.find('\n', start), content.size());
    std::string text = content.substr(start, stop - start);
    start = stop + 1;
    ++line;
    while (!text.empty() && (text.back() == '\r' || text.back() == ' ')) text.pop_back();
    if (text.empty()) continue;
    auto problem = [&](const std::string& what) {
      return pdo::io_error("digits: " + path + " line " + std::to_string(line) + ": " + what);
    };
    std::vector<double> fields;
    const char* at = text.c_str();
    for (;;) {
      char* end = nullptr;
      const double v = std::strtod(at, &end);
      if (end == at) throw problem("not a number in \"" + text.substr(0, 80) + "\"");
      fields.push_back(v);
      if (*end == '\0') break;
      if (*end != ',') throw problem("expected ',' in \"" + text.substr(0, 80) + "\"");
      at = end + 1;
    }
    if (fields.size() != 65) throw problem(std::to_string(fields.size()) + " fields, expected 64 pixels and a label");
    for (std::size_t i = 0; i < 64; ++i) {
      if (!(fields[i] >= 0 && fields[i] <= 16))  // false for NaN too
        throw problem("pixel " + std::to_string(i) + " is " + std::to_string(fields[i]) + ", outside 0..16");
      pixels.push_back(static_cast<float>(fields[i] / 16.0));
    }
    const double label = fields[64];
    if (!(label >= 0 && label <= 9) || label != static_cast<double>(static_cast<int>(label)))
      throw problem("label " + std::to_string(label) + " is not a digit");
    labels.push_back(static_cast<int>(label));
  }
  if (labels.empty()) throw pdo::io_error("digits: " + path + ": no samples");
  dataset d{pdo::tensor<float, 4>({labels.size(), 1, 8, 8}), pdo::tensor<int, 1>({labels.size()})};
  std::copy(pixels.begin(), pixels.end(), d.images.data());
  std::copy(labels.begin(), labels.end(), d.labels.data());
  return d;
}

}  // namespace digits

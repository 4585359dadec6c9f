// pdo/exec/trace.hpp: pdo::trace, the timeline of everything the engine runs: every task
// with its place and lane, start and end, what it waited for (flow arrows), and the kernels,
// collectives and copies inside it; written as Chrome trace-event JSON, which Perfetto
// (ui.perfetto.dev) and chrome://tracing open.
#pragma once

#include <pdo/core/error.hpp>
#include <pdo/core/timeline.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace pdo {

namespace detail {

/// @brief The recorder behind pdo::trace: events in the order they ended. An event's rows
/// are the recorder's own copies (by place and lane name), so a recording outlives the
/// places whose lanes, and the threads, that recorded it.
class trace_recorder final : public timeline_sink {
 public:
  static trace_recorder& instance() {
    static trace_recorder* r = new trace_recorder();  // never destroyed: lanes may record while the program exits
    return *r;
  }
  void record(timeline_event e) override {
    std::lock_guard lock(mutex_);
    e.track = own(e.track);
    if (e.queued_on != nullptr) e.queued_on = own(e.queued_on);
    events_.push_back(std::move(e));
  }
  std::vector<timeline_event> events() {
    std::lock_guard lock(mutex_);
    return events_;
  }
  void clear() {
    std::lock_guard lock(mutex_);
    events_.clear();
  }
  [[nodiscard]] timeline_clock::time_point origin() const { return origin_; }
  void restart_clock() { origin_ = timeline_clock::now(); }

 private:
  trace_recorder() = default;
  /// @brief The recorder's row named as `t` (made on first use; never freed).
  const timeline_track* own(const timeline_track* t) {
    if (t == nullptr) return nullptr;
    return &tracks_.try_emplace({t->place, t->lane}, timeline_track{t->place, t->lane}).first->second;
  }
  std::mutex mutex_;
  std::vector<timeline_event> events_;
  std::map<std::pair<std::string, std::string>, timeline_track> tracks_;
  timeline_clock::time_point origin_ = timeline_clock::now();
};

/// @brief The length of the well-formed UTF-8 sequence at s[i] (1-4), or 0 when the bytes
/// there are not one (a stray continuation byte, a truncated, overlong or surrogate sequence).
inline std::size_t utf8_sequence_at(const std::string& s, std::size_t i) {
  const auto b = [&](std::size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
  const auto cont = [&](std::size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) { return b(k) >= lo && b(k) <= hi; };
  const unsigned c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF)
    return cont(1, c == 0xE0 ? 0xA0 : 0x80, c == 0xED ? 0x9F : 0xBF) && cont(2) ? 3 : 0;
  if (c >= 0xF0 && c <= 0xF4)
    return cont(1, c == 0xF0 ? 0x90 : 0x80, c == 0xF4 ? 0x8F : 0xBF) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

/// @brief `s` as a JSON string: quotes, backslashes and control characters escaped, and each
/// byte that is not part of well-formed UTF-8 (an error message may carry a file name's raw
/// bytes) written as U+FFFD, so that the trace is always valid JSON.
inline void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      const std::size_t n = utf8_sequence_at(s, i);
      if (n == 0) out += "\\ufffd", i += 1;
      else out.append(s, i, n), i += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
    ++i;
  }
  out += '"';
}

}  // namespace detail

/// @brief The timeline of what pdo runs. Between start() and stop() every engine task is
/// recorded (op, category, place and lane, start and end, the tasks it waited for) with the
/// spans inside it: kernels (op, shapes and layout), collectives (kind, group, bytes), copies
/// (bytes, from and to). json() and save() give Chrome trace-event JSON: one process per place,
/// one thread row per lane, dependencies as flow arrows. Off (the default), it costs one
/// relaxed atomic load per task.
///
///     pdo::trace::start();
///     ... train a step ...
///     pdo::trace::stop();
///     pdo::trace::save("step.json");  // open in ui.perfetto.dev or chrome://tracing
class trace {
 public:
  /// @brief Starts recording (after clearing what an earlier recording left).
  static void start() {
    auto& r = detail::trace_recorder::instance();
    r.clear();
    r.restart_clock();
    detail::timeline().store(&r, std::memory_order_release);
  }
  /// @brief Stops recording; what was recorded stays until the next start().
  static void stop() { detail::timeline().store(nullptr, std::memory_order_release); }
  /// @brief Whether it records now.
  static bool recording() { return detail::timeline_on(); }
  /// @brief How many events were recorded.
  static std::size_t size() { return detail::trace_recorder::instance().events().size(); }

  /// @brief The recording as Chrome trace-event JSON.
  static std::string json() {
    auto& r = detail::trace_recorder::instance();
    const auto events = r.events();
    const auto origin = r.origin();
    // one "process" per place (the host threads together), one "thread" per lane
    std::map<std::string, int> pids;
    std::map<std::pair<std::string, std::string>, int> tids;
    auto pid_of = [&](const detail::timeline_track* t) {
      return pids.emplace(t->place, static_cast<int>(pids.size()) + 1).first->second;
    };
    auto tid_of = [&](const detail::timeline_track* t) {
      return tids.emplace(std::pair{t->place, t->lane}, static_cast<int>(tids.size()) + 1).first->second;
    };
    auto us = [&](detail::timeline_clock::time_point t) {
      return std::chrono::duration<double, std::micro>(t - origin).count();
    };
    std::map<std::uint64_t, const detail::timeline_event*> tasks;
    for (const auto& e : events)
      if (e.id != 0) tasks[e.id] = &e;

    std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    bool first = true;
    auto begin = [&] {
      if (!first) out += ",\n";
      first = false;
    };
    char number[64];
    auto put_number = [&](const char* key, double v) {
      std::snprintf(number, sizeof number, "\"%s\":%.3f", key, v);
      out += number;
    };
    // a flow arrow `id` from `from` at `at` to the start of task `to`
    auto put_flow = [&](const char* name, const std::string& id, const detail::timeline_track* from, detail::timeline_clock::time_point at,
                        const detail::timeline_event& to) {
      for (const bool start : {true, false}) {
        begin();
        out += std::string("{\"name\":\"") + name + "\",\"cat\":\"dependency\",\"ph\":" + (start ? "\"s\"" : "\"f\",\"bp\":\"e\"") +
               ",\"id\":\"" + id + "\",";
        put_number("ts", us(start ? at : to.start));
        const detail::timeline_track* row = start ? from : to.track;
        out += ",\"pid\":" + std::to_string(pid_of(row)) + ",\"tid\":" + std::to_string(tid_of(row)) + "}";
      }
    };
    for (const auto& e : events) {
      begin();
      out += "{\"name\":";
      detail::append_json_string(out, e.name);
      out += ",\"cat\":";
      detail::append_json_string(out, e.category);
      out += e.instant ? ",\"ph\":\"i\",\"s\":\"t\"," : ",\"ph\":\"X\",";
      put_number("ts", us(e.start));
      if (!e.instant) {
        out += ',';
        put_number("dur", std::max(0.0, us(e.end) - us(e.start)));
      }
      out += ",\"pid\":" + std::to_string(pid_of(e.track)) + ",\"tid\":" + std::to_string(tid_of(e.track));
      out += ",\"args\":{\"place\":";
      detail::append_json_string(out, e.track->place);
      out += ",\"lane\":";
      detail::append_json_string(out, e.track->lane);
      if (!e.detail.empty()) {
        out += ",\"detail\":";
        detail::append_json_string(out, e.detail);
      }
      if (e.id != 0) {
        out += ",\"task\":" + std::to_string(e.id) + ",\"after\":[";
        for (std::size_t i = 0; i < e.after.size(); ++i) out += (i ? "," : "") + std::to_string(e.after[i]);
        out += "]";
        if (e.queued_on != nullptr && e.queued_at >= origin) {
          out += ",\"queued_on\":";
          detail::append_json_string(out, e.queued_on->lane);
          out += ',';
          put_number("queued_at", us(e.queued_at));
        }
      }
      out += "}}";
      // a flow arrow from where a task queued it (inside that task's span) to its start
      if (e.queued_on != nullptr && e.id != 0 && e.queued_at >= origin)
        put_flow("queues", "q" + std::to_string(e.id), e.queued_on, e.queued_at, e);
      // a flow arrow from the end of each task it waited for to its start
      for (std::uint64_t before : e.after) {
        const auto found = tasks.find(before);
        if (found == tasks.end()) continue;
        put_flow("waits for", std::to_string(before) + "." + std::to_string(e.id), found->second->track, found->second->end, e);
      }
    }
    // names of the rows
    for (const auto& [place, pid] : pids) {
      begin();
      out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(pid) + ",\"args\":{\"name\":";
      detail::append_json_string(out, place);
      out += "}}";
    }
    for (const auto& [key, tid] : tids) {
      begin();
      out += "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(pids.at(key.first)) + ",\"tid\":" +
             std::to_string(tid) + ",\"args\":{\"name\":";
      detail::append_json_string(out, key.second);
      out += "}}";
    }
    out += "\n]}\n";
    return out;
  }

  /// @brief Writes json() to `path`; a file that cannot be written is a pdo::io_error.
  static void save(const std::string& path) {
    const std::string text = json();
    std::ofstream f(path, std::ios::binary);
    if (!f) throw io_error("pdo::trace::save: cannot open " + path + " for writing");
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    if (!f) throw io_error("pdo::trace::save: could not write " + path);
  }
};

}  // namespace pdo

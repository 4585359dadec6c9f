// pdo/core/timeline.hpp: what the timeline (pdo::trace, pdo/exec/trace.hpp) learns while it
// records: the engine's tasks, and spans inside them (kernels, collectives, copies). While
// nothing records, a span costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace pdo::detail {

using timeline_clock = std::chrono::steady_clock;

/// @brief A row of the timeline: one lane of one place, or a host thread.
struct timeline_track {
  std::string place;  ///< "cpu:0", "rank1/cuda:0"; "host" for a thread that is no place's lane
  std::string lane;   ///< "compute", "communication", "copy"; for a host thread, "thread <n>"
};

/// @brief One recorded interval (or instant, when start == end).
struct timeline_event {
  const char* category = "task";  ///< "kernel", "collective", "copy", "task", "gradient"
  std::string name;
  std::string detail;             ///< shapes and layouts, bytes, from and to
  const timeline_track* track = nullptr;
  timeline_clock::time_point start, end;
  std::uint64_t id = 0;              ///< the engine's task id (0: a span inside a task)
  std::vector<std::uint64_t> after;  ///< the tasks a task waited for (flow arrows)
  /// @brief For a task queued by another while it ran (a bucket's collective by backward): the
  /// row of the task that queued it and when (a flow arrow from there); null otherwise.
  const timeline_track* queued_on = nullptr;
  timeline_clock::time_point queued_at;
  bool instant = false;
};

/// @brief Where events go while the timeline records.
struct timeline_sink {
  virtual ~timeline_sink() = default;
  virtual void record(timeline_event e) = 0;
};

inline std::atomic<timeline_sink*>& timeline() {
  static std::atomic<timeline_sink*> sink{nullptr};
  return sink;
}

/// @brief Whether the timeline records now.
inline bool timeline_on() { return timeline().load(std::memory_order_relaxed) != nullptr; }

/// @brief The calling thread's row: its lane's (set by the lane), else one of its own.
inline const timeline_track*& current_track() {
  thread_local const timeline_track* track = nullptr;
  return track;
}

inline const timeline_track* track_of_this_thread() {
  if (const timeline_track* t = current_track(); t != nullptr) return t;
  static std::atomic<int> threads{0};
  thread_local const timeline_track own{"host", "thread " + std::to_string(threads.fetch_add(1))};
  return &own;
}

/// @brief Whether the calling thread runs a task that started before the timeline recorded:
/// the spans inside it are not recorded either (a span is shown inside its task).
inline bool& in_untraced_task() {
  thread_local bool untraced = false;
  return untraced;
}

/// @brief Records the interval from its construction to its end, while the timeline records:
/// `describe()` (the detail) is called only then.
class timeline_span {
 public:
  template <class Describe>
  timeline_span(const char* category, const char* name, Describe&& describe) {
    if (!timeline_on() || in_untraced_task()) return;
    event_ = std::make_unique<timeline_event>();
    auto& e = *event_;
    e.category = category;
    e.name = name;
    e.detail = std::forward<Describe>(describe)();
    e.track = track_of_this_thread();
    e.start = timeline_clock::now();
  }
  timeline_span(const timeline_span&) = delete;
  timeline_span& operator=(const timeline_span&) = delete;
  ~timeline_span() {
    if (!event_) return;
    event_->end = timeline_clock::now();
    if (timeline_sink* sink = timeline().load(std::memory_order_acquire); sink != nullptr) sink->record(std::move(*event_));
  }

 private:
  std::unique_ptr<timeline_event> event_;  ///< null while the timeline is off
};

/// @brief Records an instant (a gradient complete, say), while the timeline records.
template <class Describe>
void timeline_instant(const char* category, std::string name, Describe&& describe) {
  timeline_sink* sink = timeline().load(std::memory_order_acquire);
  if (sink == nullptr || in_untraced_task()) return;
  timeline_event e;
  e.category = category;
  e.name = std::move(name);
  e.detail = std::forward<Describe>(describe)();
  e.track = track_of_this_thread();
  e.start = e.end = timeline_clock::now();
  e.instant = true;
  sink->record(std::move(e));
}

}  // namespace pdo::detail

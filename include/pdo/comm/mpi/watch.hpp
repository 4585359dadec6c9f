// pdo/comm/mpi/watch.hpp: waits on MPI with a timeout, and what a waiting process tells the
// others, so that a collective that times out names the processes that did not arrive.
//
// Every wait of the MPI backend that depends on other processes arriving (the agreement step
// that opens each collective, barriers, point-to-point transfers, the agreement on a mesh)
// polls its request here. While it polls, it answers the other processes' questions: "where
// are you waiting?". A wait that runs past the timeout asks every other member of its group
// that question, names those that are not in the same collective (and where they are, if
// they answered), tells the members that did arrive that it gave up, and throws
// pdo::collective_timeout. A wait that lasts more than a moment asks once early, so that a
// process ended by its launcher (a peer died) can say on its way out who had not arrived.
#pragma once

#include <pdo/comm/barrier.hpp>
#include <pdo/comm/mpi/environment.hpp>
#include <pdo/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <time.h>
#include <unistd.h>

namespace pdo::mpi::detail {

using watch_clock = std::chrono::steady_clock;

/// @brief The timeout of a collective when its mesh sets none: $PDO_COLLECTIVE_TIMEOUT
/// seconds, else 30 minutes (PyTorch's process-group default).
inline std::chrono::duration<double> default_collective_timeout() {
  if (const char* text = std::getenv("PDO_COLLECTIVE_TIMEOUT"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(seconds > 0))
      throw communication_error(std::string("mpi: PDO_COLLECTIVE_TIMEOUT is \"") + text + "\"; give a positive number of seconds");
    return std::chrono::duration<double>(seconds);
  }
  return std::chrono::minutes(30);
}

/// @brief What a process waits in: a collective of a group (its id is the same on every
/// process, `seq` counts the group's collectives), or a transfer (seq 0), and how to name it.
struct wait_label {
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::string what;  ///< "all_reduce over axis \"dp\" of mesh(dp=4)"
};

/// @brief The waits of this process, and the conversation with the other processes about them.
class watch {
 public:
  static watch& instance() {
    static watch* w = new watch();  // never destroyed: waits may run while the program exits
    return *w;
  }

  /// @brief Makes the communicators the conversation and the mesh agreements travel on.
  /// Collective over MPI_COMM_WORLD: every process calls it at the same point of the program
  /// (pdo::mpi::world_places does), the first time only.
  void start() {
    std::call_once(started_, [this] {
      check(MPI_Comm_dup(MPI_COMM_WORLD, &talk_), "MPI_Comm_dup");
      check(MPI_Comm_dup(MPI_COMM_WORLD, &agree_), "MPI_Comm_dup");
      MPI_Comm_rank(MPI_COMM_WORLD, &me_);
      int n = 0;
      MPI_Comm_size(MPI_COMM_WORLD, &n);
      ended_.assign(static_cast<std::size_t>(n), 0);
      install_signal_note();
      before_finalize() = [] { instance().linger_at_exit(); };
    });
  }

  /// @brief At the program's end, when pdo started MPI (before MPI_Finalize, which waits for
  /// every process anyway): until every process has come to its end too, answers the
  /// questions of those that wait for this one in a collective with a notice that it has
  /// ended, so that their collective fails at once rather than at its timeout.
  void linger_at_exit() {
    MPI_Request request = MPI_REQUEST_NULL;
    if (talk_ == MPI_COMM_NULL || MPI_Ibarrier(talk_, &request) != MPI_SUCCESS) return;
    exiting_.store(true, std::memory_order_release);
    const auto start = watch_clock::now();
    for (std::size_t spins = 0;; ++spins) {
      int done = 0;
      if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done != 0) return;
      serve();
      back_off(spins, watch_clock::now() - start);
    }
  }
  [[nodiscard]] MPI_Comm agreement_comm() const { return agree_; }
  [[nodiscard]] int rank() const { return me_; }
  /// @brief The label of the next step every process takes together on the agreement
  /// communicator (group 0: the steps are numbered alike on every process).
  wait_label next_agreement(std::string what) { return {0, ++agreements_, std::move(what)}; }
  /// @brief Every process but this one, by world rank.
  [[nodiscard]] std::vector<int> others() const {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    std::vector<int> peers;
    for (int r = 0; r < n; ++r)
      if (r != me_) peers.push_back(r);
    return peers;
  }

  /// @brief Polls `done()` (an MPI_Test, an MPI_Improbe) until it returns true. Past
  /// `timeout`, or when a member of `peers` (world ranks) says it gave up on the same
  /// collective, throws pdo::collective_timeout naming `label` and the peers that did not
  /// arrive; with `can_go_on` false (the request would read a buffer the caller frees) it
  /// prints that message and ends the job instead.
  template <class Done>
  void wait(Done&& done, const wait_label& label, const std::vector<int>& peers, std::chrono::duration<double> timeout,
            bool can_go_on) {
    active_wait w{&label, false, {}};
    enlist(&w);
    struct leave {
      watch* self;
      active_wait* w;
      ~leave() { self->delist(w); }
    } guard{this, &w};
    const auto start = watch_clock::now(), deadline = start + std::chrono::duration_cast<watch_clock::duration>(timeout);
    // how long a round waits for answers: the last one, which decides, up to 2 s; the others 0.2 s
    const auto grace = std::chrono::duration_cast<watch_clock::duration>(
        std::clamp(timeout / 4, std::chrono::duration<double>(0.2), std::chrono::duration<double>(2.0)));
    const auto early_grace = std::chrono::duration_cast<watch_clock::duration>(std::chrono::duration<double>(0.2));
    const auto period = std::chrono::duration_cast<watch_clock::duration>(
        std::max(timeout / 8, std::chrono::duration<double>(2.0)));
    auto next_round = start + std::chrono::milliseconds(100);
    round r;
    bool final_round = false;
    watch_clock::time_point ended_seen{};  // when a peer was first known to have ended
    for (std::size_t spins = 0;; ++spins) {
      serve();
      if (w.given_up) fail(w.give_up_text, can_go_on);
      if (done()) {
        serve();  // a peer may have given up on this collective before it could complete here
        if (w.given_up) fail(w.give_up_text, can_go_on);
        return;
      }
      const auto now = watch_clock::now();
      if (const int gone = first_ended(peers); gone >= 0) {
        // what it sent before it ended still arrives: the collective may yet complete here
        if (ended_seen == watch_clock::time_point{}) ended_seen = now;
        else if (now - ended_seen >= ended_grace) ended_without_joining(label, gone, now - start, can_go_on);
      }
      if (r.open) {
        const std::size_t before = r.answered;
        collect(r, label, peers);
        if (r.answered != before) note_status(label, r, peers, now - start);
        if (r.answered == peers.size() || now >= r.ends) {
          r.open = false;
          note_status(label, r, peers, now - start);
          if (final_round) give_up(label, r, peers, now - start, timeout, can_go_on);
        }
      } else if (now >= deadline) {
        final_round = true;
        ask(r, label, peers, now + grace);
      } else if (now >= next_round) {
        ask(r, label, peers, now + early_grace);
        note_status(label, r, peers, now - start);
        next_round = now + period;
      }
      back_off(spins, now - start);
    }
  }

 private:
  static constexpr int tag_question = 1, tag_give_up = 2, tag_ended = 3, tag_answers = 100, answer_tags = 16000;
  /// @brief How long a collective still waits after a member is known to have ended.
  static constexpr auto ended_grace = std::chrono::seconds(2);

  struct active_wait {
    const wait_label* label;
    bool given_up = false;
    std::string give_up_text;
  };
  /// @brief One round of questions: what each peer answered, if it did.
  struct round {
    bool open = false;
    std::uint64_t id = 0;
    watch_clock::time_point ends{};
    std::size_t answered = 0;
    std::vector<int> state;            ///< per peer: 0 no answer, 1 in this collective, 2 elsewhere
    std::vector<std::string> where;    ///< per peer: what it said it waits in
  };
  /// @brief A give-up notice for a collective no wait of this process was in when it came.
  struct early_give_up {
    std::uint64_t group = 0;
    std::uint64_t seq = 0;
    std::string text;
  };
  struct pending_send {
    MPI_Request request = MPI_REQUEST_NULL;
    std::string payload;
  };

  watch() = default;

  static int answer_tag(std::uint64_t group) { return tag_answers + static_cast<int>(group % answer_tags); }

  /// @brief Adds `w` to the waits; a give-up notice that came for its collective before it
  /// began (taken in while this process waited in another) gives it up at once.
  void enlist(active_wait* w) {
    std::lock_guard lock(mutex_);
    waits_.push_back(w);
    const auto early = std::find_if(early_give_ups_.begin(), early_give_ups_.end(), [&](const early_give_up& g) {
      return g.group == w->label->group && g.seq == w->label->seq;
    });
    if (early != early_give_ups_.end()) {
      w->given_up = true;
      w->give_up_text = std::move(early->text);
      early_give_ups_.erase(early);
    }
  }
  void delist(active_wait* w) {
    std::lock_guard lock(mutex_);
    std::erase(waits_, w);
    if (waits_.empty()) status_ready_.store(false, std::memory_order_release);
  }

  /// @brief Sends `payload` to `to` without waiting (kept until it completes).
  void post(std::string payload, int to, int tag) {
    std::lock_guard lock(mutex_);
    sends_.push_back({MPI_REQUEST_NULL, std::move(payload)});
    auto& s = sends_.back();
    MPI_Isend(s.payload.data(), static_cast<int>(s.payload.size()), MPI_CHAR, to, tag, talk_, &s.request);
  }

  /// @brief The text of a message matched by `message`, received.
  static std::string receive(MPI_Message& message, MPI_Status& status) {
    int length = 0;
    MPI_Get_count(&status, MPI_CHAR, &length);
    std::string text(static_cast<std::size_t>(length), '\0');
    MPI_Mrecv(text.data(), length, MPI_CHAR, &message, MPI_STATUS_IGNORE);
    return text;
  }

  /// @brief Answers the questions that arrived, takes in the give-up notices, and frees the
  /// sends that completed. Any waiting thread does it for the whole process.
  void serve() {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    while (MPI_Improbe(MPI_ANY_SOURCE, tag_question, talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
      std::istringstream in(receive(message, status));
      int reply_tag = 0;
      std::uint64_t round_id = 0;
      in >> reply_tag >> round_id;
      if (exiting_.load(std::memory_order_acquire)) {  // this process has ended: say so, whatever was asked
        post(std::to_string(me_), status.MPI_SOURCE, tag_ended);
        continue;
      }
      std::string answer = std::to_string(round_id) + "\n";
      {
        std::lock_guard lock(mutex_);
        for (const active_wait* w : waits_)
          answer += std::to_string(w->label->group) + " " + std::to_string(w->label->seq) + " " + w->label->what + "\n";
      }
      post(std::move(answer), status.MPI_SOURCE, reply_tag);
    }
    while (MPI_Improbe(MPI_ANY_SOURCE, tag_give_up, talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
      const std::string text = receive(message, status);
      std::istringstream in(text);
      std::uint64_t group = 0, seq = 0;
      in >> group >> seq;
      std::string rest;
      std::getline(in, rest);
      std::getline(in, rest, '\0');
      std::lock_guard lock(mutex_);
      bool taken = false;
      for (active_wait* w : waits_)
        if (w->label->group == group && w->label->seq == seq) {
          taken = true;
          if (w->given_up) continue;
          w->given_up = true;
          w->give_up_text = rest;
        }
      // a collective this process has not reached yet (it waits in another, and is late for
      // this one too): kept for its wait. A transfer's (seq 0) names no one call, so it is not.
      if (!taken && seq != 0) early_give_ups_.push_back({group, seq, rest});
    }
    while (MPI_Improbe(MPI_ANY_SOURCE, tag_ended, talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
      (void)receive(message, status);
      std::lock_guard lock(mutex_);
      ended_.at(static_cast<std::size_t>(status.MPI_SOURCE)) = 1;
      any_ended_.store(true, std::memory_order_release);
    }
    std::lock_guard lock(mutex_);
    for (auto it = sends_.begin(); it != sends_.end();) {
      int complete = 0;
      MPI_Test(&it->request, &complete, MPI_STATUS_IGNORE);
      it = complete ? sends_.erase(it) : std::next(it);
    }
  }

  /// @brief Opens a round: asks every peer where it waits.
  void ask(round& r, const wait_label& label, const std::vector<int>& peers, watch_clock::time_point ends) {
    r = round{true, next_round_id_.fetch_add(1, std::memory_order_relaxed) + 1, ends, 0, std::vector<int>(peers.size(), 0),
              std::vector<std::string>(peers.size())};
    for (int peer : peers) post(std::to_string(answer_tag(label.group)) + " " + std::to_string(r.id), peer, tag_question);
  }

  /// @brief Takes in the answers that arrived (late answers of earlier rounds are dropped).
  void collect(round& r, const wait_label& label, const std::vector<int>& peers) {
    for (std::size_t i = 0; i < peers.size(); ++i) {
      int flag = 0;
      MPI_Message message;
      MPI_Status status;
      while (MPI_Improbe(peers[i], answer_tag(label.group), talk_, &flag, &message, &status) == MPI_SUCCESS && flag) {
        std::istringstream in(receive(message, status));
        std::uint64_t id = 0;
        in >> id;
        if (id != r.id || r.state[i] != 0) continue;
        ++r.answered;
        r.state[i] = 2;
        std::string line;
        std::getline(in, line);
        while (std::getline(in, line)) {
          std::istringstream fields(line);
          std::uint64_t group = 0, seq = 0;
          fields >> group >> seq;
          std::string what;
          std::getline(fields >> std::ws, what);
          if (group == label.group && seq == label.seq) r.state[i] = 1;
          else r.where[i] += (r.where[i].empty() ? "" : "; ") + what + (seq != 0 ? " (collective #" + std::to_string(seq) + " there)" : "");
        }
      }
    }
  }

  /// @brief "rank 2 (waiting in ...), rank 3 (did not answer: ...)" for the peers not in this collective.
  static std::string missing(const round& r, const std::vector<int>& peers) {
    std::string text;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      if (r.state[i] == 1) continue;
      text += (text.empty() ? "" : ", ") + std::string("rank ") + std::to_string(peers[i]);
      if (r.state[i] == 2)
        text += r.where[i].empty() ? " (not waiting in any collective of pdo)" : " (waiting in " + r.where[i] + ")";
      else
        text += " (did not answer: busy outside pdo's collectives, stopped, or gone)";
    }
    return text;
  }

  static std::string describe(const wait_label& label) {
    return label.what + (label.seq != 0 ? " (collective #" + std::to_string(label.seq) + " of its group)" : "");
  }

  /// @brief Nanoseconds on CLOCK_MONOTONIC (which a signal handler may read).
  static std::int64_t monotonic_ns() {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
  }

  /// @brief Keeps a line about this wait for the signal note (see install_signal_note): the
  /// text before and after the time waited, which the note reckons when it is written (the
  /// line is kept at each round of questions, which may be minutes apart).
  void note_status(const wait_label& label, const round& r, const std::vector<int>& peers, watch_clock::duration waited) {
    const std::string who = missing(r, peers);
    const std::string before = "pdo: rank " + std::to_string(me_) + ": ended while waiting in " + describe(label) + "; after ";
    const std::string after = " s, " + (who.empty() ? std::string("every other member had arrived") : "not arrived: " + who) + "\n";
    std::lock_guard lock(mutex_);
    const std::size_t split = std::min(before.size(), sizeof(status_) - 1);
    const std::size_t n = std::min(split + after.size(), sizeof(status_) - 1);
    std::memcpy(status_, before.data(), split);
    std::memcpy(status_ + split, after.data(), n - split);
    status_[n] = '\0';
    status_split_ = split;
    status_length_ = n;
    status_since_ns_ = monotonic_ns() - std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
    status_ready_.store(true, std::memory_order_release);
  }

  /// @brief Writes the kept line to stderr with the time waited until now ("12.3"): only
  /// calls a signal handler may make.
  void write_status_note() const {
    const std::int64_t tenths = std::max<std::int64_t>(0, (monotonic_ns() - status_since_ns_) / 100000000);
    char digits[24];
    std::size_t n = 0;
    digits[n++] = static_cast<char>('0' + tenths % 10);
    digits[n++] = '.';
    for (std::int64_t whole = tenths / 10; n == 2 || whole > 0; whole /= 10) digits[n++] = static_cast<char>('0' + whole % 10);
    char number[24];
    for (std::size_t i = 0; i < n; ++i) number[i] = digits[n - 1 - i];
    ssize_t written = ::write(2, status_, status_split_);
    written = ::write(2, number, n);
    written = ::write(2, status_ + status_split_, status_length_ - status_split_);
    (void)written;
  }

  /// @brief The timeout: the message, sent to every peer (those that arrived give up too,
  /// with it), then thrown or, when the process cannot go on, printed before the job ends.
  ///
  /// The wait it reports is the timeout and the last round of questions (up to 2 s) after it.
  [[noreturn]] void give_up(const wait_label& label, const round& r, const std::vector<int>& peers, watch_clock::duration waited,
                            std::chrono::duration<double> timeout, bool can_go_on) {
    std::ostringstream os;
    os << describe(label) << " timed out after " << std::chrono::duration<double>(waited).count() << " s (timeout "
       << timeout.count() << " s, then a last round asking the others where they wait) on rank " << me_
       << ": not arrived: " << missing(r, peers)
       << ". The group cannot be used after this; if those processes are only slow, raise the timeout "
          "(PDO_COLLECTIVE_TIMEOUT=<seconds>, or mesh_options::collective_timeout)";
    const std::string message = os.str();
    for (int peer : peers)
      post(std::to_string(label.group) + " " + std::to_string(label.seq) + "\nrank " + std::to_string(me_) + " gave up: " + message,
           peer, tag_give_up);
    serve();
    fail(message, can_go_on);
  }

  /// @brief The first of `peers` known to have ended its program, or -1.
  int first_ended(const std::vector<int>& peers) {
    if (!any_ended_.load(std::memory_order_acquire)) return -1;
    std::lock_guard lock(mutex_);
    for (int peer : peers)
      if (ended_.at(static_cast<std::size_t>(peer)) != 0) return peer;
    return -1;
  }

  /// @brief A member of the collective has ended its program without joining it: the
  /// collective cannot complete (a pdo::collective_timeout, as when it does not arrive in time).
  [[noreturn]] void ended_without_joining(const wait_label& label, int gone, watch_clock::duration waited, bool can_go_on) const {
    std::ostringstream os;
    os << describe(label) << " cannot complete on rank " << me_ << ": rank " << gone
       << " has ended its program (returned from main, or called exit) without joining it; waited "
       << std::chrono::duration<double>(waited).count()
       << " s. The group cannot be used after this; every process must take part in each collective of its groups";
    fail(os.str(), can_go_on);
  }

  [[noreturn]] static void fail(const std::string& message, bool can_go_on) {
    if (can_go_on) throw collective_timeout(message);
    std::fprintf(stderr, "pdo: fatal: %s; a transfer still holds a buffer of this process, ending the job\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::terminate();
  }

  /// @brief Spins while the wait is young, then yields, then sleeps briefly between polls.
  static void back_off(std::size_t spins, watch_clock::duration waited) {
    if (spins < 2000) pdo::detail::cpu_relax();
    else if (waited < std::chrono::milliseconds(10)) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  /// @brief On SIGTERM (how a launcher ends the job when a process died), writes the line
  /// note_status kept, then ends as SIGTERM would have. Installed only where the program has
  /// no handler of its own.
  void install_signal_note() {
    struct sigaction current {};
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction note {};
    note.sa_handler = [](int) {
      const watch& w = instance();
      if (w.status_ready_.load(std::memory_order_acquire)) w.write_status_note();
      std::signal(SIGTERM, SIG_DFL);
      std::raise(SIGTERM);
    };
    sigemptyset(&note.sa_mask);
    sigaction(SIGTERM, &note, nullptr);
  }

  std::once_flag started_;
  MPI_Comm talk_ = MPI_COMM_NULL, agree_ = MPI_COMM_NULL;
  int me_ = 0;
  std::mutex mutex_;
  std::vector<active_wait*> waits_;
  std::vector<early_give_up> early_give_ups_;
  std::list<pending_send> sends_;
  std::atomic<std::uint64_t> next_round_id_{0};
  std::uint64_t agreements_ = 0;  ///< steps taken on the agreement communicator
  char status_[1024] = {};
  std::size_t status_length_ = 0;
  std::size_t status_split_ = 0;       ///< where the time waited goes in status_
  std::int64_t status_since_ns_ = 0;   ///< when the wait began (monotonic_ns)
  std::atomic<bool> status_ready_{false};
  std::atomic<bool> exiting_{false};  ///< this process has ended its program (linger_at_exit)
  std::vector<char> ended_;           ///< per world rank: it said it has ended
  std::atomic<bool> any_ended_{false};
};

}  // namespace pdo::mpi::detail

// The shared-memory activation ring of include/stagewise/ring.h: SPSC counters
// with acquire/release atomics, spin-then-futex waiting, peer liveness.
#include "stagewise/ring.h"

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace stagewise {

namespace {

using Clock = std::chrono::steady_clock;

// A sleeper wakes at least this often to look at its peer's liveness.
constexpr int64_t kLivenessCheckNs = 20'000'000;
// Busy-wait polls before the spinner starts yielding its CPU (about a microsecond).
constexpr int kPauseSpins = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Not FUTEX_*_PRIVATE: the word is shared between processes.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Bumps the futex word and wakes its sleepers, if any. Together with the
// sleeper's (flag store; seq load; recheck) in wait_for(), the seq_cst order
// guarantees that either we see the flag or the sleeper sees the new seq.
void signal(std::atomic<uint32_t>* seq, std::atomic<uint32_t>* sleeping) {
  seq->fetch_add(1, std::memory_order_seq_cst);
  if (sleeping->load(std::memory_order_seq_cst) != 0) futex_wake_all(seq);
}

bool peer_gone(const RingHeader* h) {
  const int32_t self = static_cast<int32_t>(getpid());
  const int32_t attacher = h->attacher_pid.load(std::memory_order_acquire);
  const int32_t peer = self == h->creator_pid ? attacher : h->creator_pid;
  if (peer <= 0 || peer == self) return false;  // not attached yet, or both ends in this process
  return kill(peer, 0) != 0 && errno == ESRCH;
}

int64_t to_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// When a waiter spins: [from, until) on its clock (from == until: no spin);
// paced: the consumer's window around a message that is due.
struct SpinWindow {
  Clock::time_point from, until;
  bool paced = false;
};

// The consumer's window around its next message, from how long it waited for
// the last ones (see ring.h); `fallback` (a spin from `start`) when that is not
// known yet or the message is already overdue by more than the margin.
SpinWindow paced_window(RingHeader* h, Clock::time_point start, SpinWindow fallback) {
  const int64_t now = to_ns(start);
  if (h->wait_start_ns == 0) h->wait_start_ns = now;  // the ring was found empty: a wait begins
  const int64_t expected = std::min(h->wait_ns[0], h->wait_ns[1]);
  if (expected <= 0) return fallback;
  const int64_t margin = std::clamp(expected / 8, kRingPaceMinNs, kRingPaceMaxNs);
  const int64_t due = h->wait_start_ns + expected;
  if (now >= due + margin) return fallback;
  const auto at = [&](int64_t ns) { return start + std::chrono::nanoseconds(ns - now); };
  return {at(std::max(now, due - margin)), at(std::max(due + margin, to_ns(fallback.until))), true};
}

// The consumer got message `tail`: how long it waited for it, when it did.
void record_arrival(RingHeader* h, uint64_t tail) {
  if (h->arrival_counted == tail + 1) return;  // acquired again before its release
  h->arrival_counted = tail + 1;
  if (h->wait_start_ns == 0) return;  // it was there at once: nothing learnt
  h->wait_ns[1] = h->wait_ns[0];
  h->wait_ns[0] = to_ns(Clock::now()) - h->wait_start_ns;
  h->wait_start_ns = 0;
}

// Sleeps on the futex until ready(), closed or `until` (max(): no end),
// waking every kLivenessCheckNs to look at the peer. Returns 1 when ready,
// kRingClosed, or 0 once `until` passed.
template <typename Ready>
int64_t sleep_until(RingHeader* h, std::atomic<uint32_t>* seq, std::atomic<uint32_t>* sleeping,
                    Clock::time_point until, Ready ready) {
  for (;;) {
    const auto now = Clock::now();
    if (now >= until) return 0;
    sleeping->fetch_add(1, std::memory_order_seq_cst);
    const uint32_t expected = seq->load(std::memory_order_seq_cst);
    const bool wake_now = ready() || h->closed.load(std::memory_order_seq_cst);
    if (!wake_now) {
      int64_t ns = kLivenessCheckNs;
      if (until != Clock::time_point::max()) {
        ns = std::min<int64_t>(ns, std::chrono::duration_cast<std::chrono::nanoseconds>(until - now).count());
      }
      futex_wait(seq, expected, std::max<int64_t>(ns, 1));
    }
    sleeping->fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return 1;
    if (h->closed.load(std::memory_order_acquire)) return ready() ? 1 : kRingClosed;
    if (peer_gone(h)) {  // it died without closing: a crash or a kill
      h->closed.store(1, std::memory_order_release);
      return ready() ? 1 : kRingClosed;
    }
  }
}

// Waits until ready() or the ring is closed (or its peer gone), at most
// timeout_us (< 0: forever). Returns 1 when ready, kRingClosed or kRingTimedOut.
// `ready` is checked first, so a consumer drains the committed messages of a
// closed ring (ring_reserve checks `closed` itself). The waiter sleeps, spins
// over its window (`paced`: the consumer's, else spin_ns from now), then sleeps.
// With a due_mode it returns kRingDue when it slept until its paced window
// began, and when its timeout ends inside that window (the message still due);
// with kDueAtOnce also at once when called inside the window.
template <typename Ready>
int64_t wait_for(RingHeader* h, std::atomic<uint32_t>* seq, std::atomic<uint32_t>* sleeping,
                 int64_t timeout_us, Ready ready, bool paced, int due_mode = 0) {
  if (ready()) return 1;
  if (h->closed.load(std::memory_order_acquire)) return ready() ? 1 : kRingClosed;
  if (timeout_us == 0) return kRingTimedOut;
  const auto start = Clock::now();
  const auto deadline = timeout_us < 0 ? Clock::time_point::max()
                                       : start + std::chrono::microseconds(timeout_us);
  SpinWindow spin{start, start + std::chrono::nanoseconds(h->spin_ns)};
  if (paced) spin = paced_window(h, start, spin);
  if (due_mode == kDueAtOnce && spin.paced && spin.from <= start) return kRingDue;  // due already
  if (spin.from > start) {  // the message is not due yet
    const int64_t r = sleep_until(h, seq, sleeping, std::min(spin.from, deadline), ready);
    if (r != 0) return r;
    if (due_mode != 0 && spin.from <= deadline) return kRingDue;
  }
  for (int i = 0;; ++i) {
    if (ready()) return 1;
    if (h->closed.load(std::memory_order_acquire)) return ready() ? 1 : kRingClosed;
    if (i < kPauseSpins) {
      cpu_relax();
      continue;
    }
    const auto now = Clock::now();
    if (now >= spin.until) break;
    if (now >= deadline) return due_mode != 0 && spin.paced && now >= spin.from ? kRingDue : kRingTimedOut;
    // Yield rather than burn: when the peer waits for a CPU (more runnable
    // processes than cores), it may be the one queued behind this spinner.
    sched_yield();
  }
  const int64_t r = sleep_until(h, seq, sleeping, deadline, ready);
  return r != 0 ? r : kRingTimedOut;
}

}  // namespace

RingLayout ring_layout(uint64_t slot_bytes, uint64_t num_slots, uint32_t flags) {
  RingLayout l{};
  if (slot_bytes == 0 || num_slots == 0 || slot_bytes > (uint64_t{1} << 40) || num_slots > (uint64_t{1} << 20)) {
    return l;
  }
  l.slot_stride = (slot_bytes + kRingSlotAlign - 1) / kRingSlotAlign * kRingSlotAlign;
  const uint64_t meta = sizeof(RingHeader) + num_slots * sizeof(uint64_t);
  l.data_offset = (meta + kRingDataAlign - 1) / kRingDataAlign * kRingDataAlign;
  const uint64_t data = (flags & kRingExternalSlots) ? 0 : l.slot_stride * num_slots;
  l.total_bytes = l.data_offset + data;
  return l;
}

const char* ring_check(const void* mem, uint64_t mem_bytes) {
  if (mem_bytes < sizeof(RingHeader)) return "the segment is smaller than a ring header";
  const auto* h = static_cast<const RingHeader*>(mem);
  if (h->magic != kRingMagic) return "the segment does not start with the ring magic (not a stagewise ring)";
  if (h->version != kRingVersion) return "the ring was written by another version of stagewise";
  const RingLayout l = ring_layout(h->slot_bytes, h->num_slots, h->flags);
  if (l.total_bytes == 0 || l.slot_stride != h->slot_stride || l.data_offset != h->data_offset ||
      l.total_bytes != h->total_bytes) {
    return "the ring header's geometry is inconsistent";
  }
  if (h->total_bytes > mem_bytes) return "the segment is smaller than the ring header says";
  return nullptr;
}

std::string ring_status_message(const char* op, RingStatus s, const RingHeader* h, int64_t slot,
                                int64_t nbytes) {
  const std::string prefix = std::string("stagewise.") + op + ": ";
  const bool commit = std::strcmp(op, "ring_commit") == 0;
  const uint64_t next = (commit ? h->head.load() : h->tail.load()) % h->num_slots;
  switch (s) {
    case RingStatus::kOk:
      return {};
    case RingStatus::kBadSlot:
      return prefix + "argument 'slot' must be the " + (commit ? "reserved" : "acquired") + " slot " +
             std::to_string(next) + ", got " + std::to_string(slot);
    case RingStatus::kTooLarge:
      return prefix + "argument 'nbytes' must be at most the slot size " + std::to_string(h->slot_bytes) +
             ", got " + std::to_string(nbytes);
    case RingStatus::kNotReserved:
      return prefix + (commit ? "no slot is free to commit (the ring is full; reserve a slot first)"
                              : "no message to release (the ring is empty; acquire one first)");
  }
  return prefix + "unknown ring status";
}

namespace cpu {

void ring_init(void* mem, uint64_t slot_bytes, uint64_t num_slots, uint32_t flags, int64_t spin_ns) {
  const RingLayout l = ring_layout(slot_bytes, num_slots, flags);
  auto* h = new (mem) RingHeader{};  // value-initialised: counters and flags zero
  h->version = kRingVersion;
  h->flags = flags;
  h->slot_bytes = slot_bytes;
  h->slot_stride = l.slot_stride;
  h->num_slots = num_slots;
  h->data_offset = l.data_offset;
  h->total_bytes = l.total_bytes;
  h->spin_ns = spin_ns < 0 ? 0 : spin_ns;
  h->creator_pid = static_cast<int32_t>(getpid());
  std::memset(ring_nbytes_table(h), 0, num_slots * sizeof(uint64_t));
  // Last, so that a header with the magic is complete.
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kRingMagic;
}

void ring_attach(RingHeader* h) {
  h->attacher_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

int64_t ring_reserve(RingHeader* h, int64_t timeout_us) {
  const uint64_t head = h->head.load(std::memory_order_relaxed);  // ours
  const uint64_t n = h->num_slots;
  // Closed first: a reader that went away will never free a slot.
  if (h->closed.load(std::memory_order_acquire)) return kRingClosed;
  auto has_space = [&] { return head - h->tail.load(std::memory_order_acquire) < n; };
  const int64_t r = wait_for(h, &h->space_seq, &h->producer_sleeping, timeout_us, has_space, false);
  if (r != 1) return r;
  if (h->closed.load(std::memory_order_acquire)) return kRingClosed;
  return static_cast<int64_t>(head % n);
}

RingStatus ring_commit(RingHeader* h, int64_t slot, uint64_t nbytes) {
  const uint64_t head = h->head.load(std::memory_order_relaxed);
  if (head - h->tail.load(std::memory_order_acquire) >= h->num_slots) return RingStatus::kNotReserved;
  if (slot < 0 || static_cast<uint64_t>(slot) != head % h->num_slots) return RingStatus::kBadSlot;
  if (nbytes > h->slot_bytes) return RingStatus::kTooLarge;
  ring_nbytes_table(h)[slot] = nbytes;
  h->head.store(head + 1, std::memory_order_release);
  signal(&h->data_seq, &h->consumer_sleeping);
  return RingStatus::kOk;
}

int64_t ring_acquire(RingHeader* h, int64_t timeout_us, uint64_t* nbytes, int due_mode) {
  const uint64_t tail = h->tail.load(std::memory_order_relaxed);  // ours
  auto has_data = [&] { return h->head.load(std::memory_order_acquire) != tail; };
  const int64_t r =
      wait_for(h, &h->data_seq, &h->consumer_sleeping, timeout_us, has_data, true, due_mode);
  if (r != 1) return r;
  record_arrival(h, tail);
  const int64_t slot = static_cast<int64_t>(tail % h->num_slots);
  // Clamped: the producer's process is not trusted to stay inside the slot.
  const uint64_t size = ring_nbytes_table(h)[slot];
  *nbytes = size < h->slot_bytes ? size : h->slot_bytes;
  return slot;
}

RingStatus ring_release(RingHeader* h, int64_t slot) {
  const uint64_t tail = h->tail.load(std::memory_order_relaxed);
  if (h->head.load(std::memory_order_acquire) == tail) return RingStatus::kNotReserved;
  if (slot < 0 || static_cast<uint64_t>(slot) != tail % h->num_slots) return RingStatus::kBadSlot;
  h->tail.store(tail + 1, std::memory_order_release);
  signal(&h->space_seq, &h->producer_sleeping);
  return RingStatus::kOk;
}

void ring_close(RingHeader* h) {
  h->closed.store(1, std::memory_order_seq_cst);
  h->data_seq.fetch_add(1, std::memory_order_seq_cst);
  h->space_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&h->data_seq);
  futex_wake_all(&h->space_seq);
}

}  // namespace cpu
}  // namespace stagewise

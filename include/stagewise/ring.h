// Activation ring: a single-producer single-consumer queue of fixed-size slots
// in memory that two processes map (a POSIX shared-memory segment), carrying
// opaque byte messages between adjacent pipeline stages on one host.
//
// Layout of the segment (all offsets from its start, little-endian host):
//   [RingHeader]                  geometry, counters, flags (cache-line padded)
//   [uint64 nbytes[num_slots]]    message size of each slot, written by the producer
//   [pad to kRingDataAlign]
//   [slot 0][slot 1]...           num_slots * slot_stride bytes (absent when the
//                                 slots live elsewhere: kRingExternalSlots, e.g. GPU memory)
//
// Counters: `head` counts committed messages (written by the producer only),
// `tail` counts released ones (consumer only); message i lives in slot
// i % num_slots. The producer publishes a message with head.store(release)
// after writing its bytes and nbytes[slot]; the consumer reads them after
// head.load(acquire); symmetrically for tail and slot reuse. A waiter spins for
// spin_ns, then sleeps on a futex word (data_seq / space_seq) that the other
// side bumps and wakes only when someone sleeps there.
//
// The consumer also paces its waits by the rhythm of its messages (a pipeline
// stage in steady decode waits about as long for each step: the stages before
// it computing theirs). Its wait for a message is expected to last as long as
// the shorter of its last two waits that ended with one, counted from the first
// acquire that found the ring empty (over any number of timed-out calls): it
// sleeps until a margin before that, spins (yielding its CPU) until a margin
// after, then sleeps again. The margin is an eighth of the expected wait, within
// [kRingPaceMinNs, kRingPaceMaxNs]: at most 4 ms of spinning per message, and a
// message that comes early still wakes the sleeper. Waking a process that sleeps
// costs ~100-200 us on a virtual machine's idle vCPU, a spinning one a few; that
// is what the spin buys. With a due mode, ring_acquire returns kRingDue when
// the spin window begins (or has begun) and when a short timeout ends the spin
// inside it, so that the consumer can keep its caches warm for the message
// (run the code that will read it) while it is due.
//
// Either side may close the ring (closed = 1): the consumer still drains the
// messages already committed, then sees kRingClosed; the producer sees it at
// once. A waiter also treats a peer process that no longer exists as closed.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

#include "stagewise/common.h"

namespace stagewise {

inline constexpr uint64_t kRingMagic = 0x31474e4952575321ull;  // "!SWRING1" little-endian
inline constexpr uint32_t kRingVersion = 2;
inline constexpr uint64_t kRingDataAlign = 4096;  // slot 0 starts on a page
inline constexpr uint64_t kRingSlotAlign = 64;    // slot stride: whole cache lines
inline constexpr uint32_t kRingUserBytes = 128;   // opaque bytes for the transport (an IPC handle)
inline constexpr int64_t kRingPaceMinNs = 50'000;     // the consumer's spin margin, at least
inline constexpr int64_t kRingPaceMaxNs = 2'000'000;  // and at most

// Flags of RingHeader::flags.
inline constexpr uint32_t kRingExternalSlots = 1;  // the segment holds no slot bytes

// Results of ring_reserve / ring_acquire besides a slot index (>= 0).
inline constexpr int64_t kRingTimedOut = -1;
inline constexpr int64_t kRingClosed = -2;
// ring_acquire with a due mode: the message is due and has not come (the
// consumer's pacing, below): the caller may make ready for it, then call again.
inline constexpr int64_t kRingDue = -3;
// ring_acquire's due modes: kDueAtOnce returns kRingDue when the wait slept
// until the message was due, or at once if it already is; kDueAfter spins in
// the window for the timeout first (the call after a kRingDue).
inline constexpr int kDueAtOnce = 1;
inline constexpr int kDueAfter = 2;

// Results of the checks of ring_commit / ring_release.
enum class RingStatus : int32_t {
  kOk = 0,
  kBadSlot = 1,      // not the slot the protocol allows next
  kTooLarge = 2,     // nbytes > slot_bytes
  kNotReserved = 3,  // commit on a full ring / release on an empty ring
};

struct alignas(64) RingHeader {
  // Set by ring_init before the segment is published; read-only afterwards.
  uint64_t magic;
  uint32_t version;
  uint32_t flags;
  uint64_t slot_bytes;   // capacity of one slot
  uint64_t slot_stride;  // bytes from one slot to the next (slot_bytes rounded up)
  uint64_t num_slots;
  uint64_t data_offset;  // of slot 0 (== total_bytes with kRingExternalSlots)
  uint64_t total_bytes;  // of the segment
  int64_t spin_ns;       // how long a waiter spins before it sleeps
  int32_t creator_pid;
  std::atomic<int32_t> attacher_pid;  // 0 until the peer attaches
  uint8_t user[kRingUserBytes];

  alignas(64) std::atomic<uint64_t> head;  // producer: messages committed
  std::atomic<uint32_t> data_seq;          // futex word the consumer sleeps on
  alignas(64) std::atomic<uint32_t> consumer_sleeping;
  alignas(64) std::atomic<uint64_t> tail;  // consumer: messages released
  std::atomic<uint32_t> space_seq;         // futex word the producer sleeps on
  alignas(64) std::atomic<uint32_t> producer_sleeping;
  alignas(64) std::atomic<uint32_t> closed;
  // The consumer's alone (its process's steady clock), for pacing its waits.
  alignas(64) int64_t wait_start_ns;  // when it began waiting for the next message (0: not waiting)
  int64_t wait_ns[2];                 // how long it waited for the last two that kept it waiting
  uint64_t arrival_counted;           // tail + 1 of the message last counted (acquire is idempotent)
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "the ring needs lock-free 64-bit atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the ring needs lock-free 32-bit atomics");

struct RingLayout {
  uint64_t slot_stride;
  uint64_t data_offset;
  uint64_t total_bytes;
};

// Geometry of a ring; total_bytes == 0 when the sizes overflow.
RingLayout ring_layout(uint64_t slot_bytes, uint64_t num_slots, uint32_t flags);

// The per-slot message sizes that follow the header.
inline uint64_t* ring_nbytes_table(RingHeader* h) { return reinterpret_cast<uint64_t*>(h + 1); }

// nullptr when `mem` of `mem_bytes` holds a valid ring, else why not.
const char* ring_check(const void* mem, uint64_t mem_bytes);

// The error message of a failed ring_commit / ring_release check, naming the
// argument ("stagewise.<op>: argument 'slot' ..."); `slot`/`nbytes` as given.
std::string ring_status_message(const char* op, RingStatus s, const RingHeader* h, int64_t slot,
                                int64_t nbytes);

namespace cpu {

// Writes a fresh header into `mem` (total_bytes of ring_layout, zero-filled by
// the caller). Records the calling process as the creator.
void ring_init(void* mem, uint64_t slot_bytes, uint64_t num_slots, uint32_t flags, int64_t spin_ns);

// Records the calling process as the attacher (the creator's peer).
void ring_attach(RingHeader* h);

// Producer: waits up to timeout_us (< 0: forever) for a free slot; returns its
// index, kRingTimedOut or kRingClosed. Idempotent until the commit.
int64_t ring_reserve(RingHeader* h, int64_t timeout_us);
// Producer: publishes `nbytes` bytes written into the reserved slot.
RingStatus ring_commit(RingHeader* h, int64_t slot, uint64_t nbytes);

// Consumer: waits up to timeout_us for a message; returns its slot (and its
// size in *nbytes), kRingTimedOut or kRingClosed (closed and drained); with a
// due_mode (kDueAtOnce, kDueAfter), kRingDue while the message is due (above).
int64_t ring_acquire(RingHeader* h, int64_t timeout_us, uint64_t* nbytes, int due_mode = 0);
// Consumer: gives the acquired slot back to the producer.
RingStatus ring_release(RingHeader* h, int64_t slot);

// Either side: marks the ring closed and wakes every waiter.
void ring_close(RingHeader* h);

}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
// CUDA IPC ring: the slots (and two 32-bit counters) live in one cudaMalloc
// allocation shared through CUDA IPC; the host-side ring above (with
// kRingExternalSlots) orders the metadata, stream memory operations order the
// bytes: the producer's stream waits until the consumer's stream has released
// a slot before writing it, the consumer's stream waits until the producer's
// stream has written it. No host thread waits on the GPU.
namespace cuda {

inline constexpr int kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

// Allocates `nbytes` zeroed device bytes on the current device.
cudaError_t ipc_alloc(void** ptr, uint64_t nbytes);
cudaError_t ipc_free(void* ptr);
// Writes the IPC handle of an ipc_alloc allocation (kIpcHandleBytes bytes).
cudaError_t ipc_get_handle(void* ptr, uint8_t* handle);
// Maps a peer's allocation into this process (current device).
cudaError_t ipc_open(const uint8_t* handle, void** ptr);
cudaError_t ipc_close(void* ptr);
// The GPU whose memory `ptr` is (for a mapped peer allocation: the creator's), and whether
// `device` can reach `peer`'s memory directly (peer access over NVLink/PCIe).
cudaError_t pointer_device(const void* ptr, int* device);
cudaError_t can_access_peer(int device, int peer, bool* ok);

// Enqueues on `stream`: wait until the 32-bit counter at `addr` (device
// memory) has reached `value` (wrap-aware: (int32)(*addr - value) >= 0).
cudaError_t stream_wait_counter(cudaStream_t stream, uint32_t* addr, uint32_t value);
// Enqueues on `stream`: once the work before it is done and visible
// system-wide, store `value` into the counter at `addr`.
cudaError_t stream_write_counter(cudaStream_t stream, uint32_t* addr, uint32_t value);

}  // namespace cuda
#endif

}  // namespace stagewise

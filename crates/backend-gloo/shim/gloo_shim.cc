// gloo_shim.cc: the C interface of gloo_shim.h over libgloo (Debian libgloo-dev, GLOO_VERSION 0.5).
//
// Every extern "C" function catches every exception (`guarded`), so no C++ exception crosses the
// boundary into Rust. Failures become a status code plus Gloo's own message.

#define HIREDIS_NESTED_INCLUDE 1

#include "gloo_shim.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace {

using Millis = std::chrono::milliseconds;

// Slot prefix of user point-to-point messages (their headers, and small messages whole). Gloo's
// collectives use prefixes 0x01..0x08 (gloo/types.h) and the legacy algorithms small slot
// numbers (prefix 0), so user tags never collide with a collective.
constexpr uint8_t kP2pSlotPrefix = 0x7A;
// Slot prefix of the payloads of large point-to-point messages (the other 56 bits: the sending
// context's message number). 0x7B is taken by the probes of probe_peers.
constexpr uint8_t kP2pPayloadPrefix = 0x7C;
// Slot prefix of the receiver's answer to a large message (same 56-bit message number).
constexpr uint8_t kP2pReplyPrefix = 0x7D;
// Slot prefix of the headers (and whole small messages) of the collectives built from
// point-to-point messages (gloo_shim_exchange); the low 32 bits: the collective's tag.
constexpr uint8_t kCollSlotPrefix = 0x79;
// Slot prefix of the mismatch check's messages (gloo_shim_check_exchange), which run under the
// tag of the collective they check: apart from that collective's own messages.
constexpr uint8_t kCheckSlotPrefix = 0x78;

// Tag of the barrier that ends a rendezvous (never reached by the collective counter in practice).
constexpr uint32_t kConnectBarrierTag = 0xFFFFFFFFu;

// Message Gloo gives every other pair of a context after an application-side timeout
// (tcp/unbound_buffer.cc): it names no failed peer.
constexpr const char* kSecondaryFailure = "Application timeout caused pair closure";

void set_message(gloo_shim_status* st, const std::string& msg) {
  size_t n = std::min(msg.size(), static_cast<size_t>(GLOO_SHIM_MESSAGE_LEN - 1));
  std::memcpy(st->message, msg.data(), n);
  st->message[n] = '\0';
}

int32_t ok(gloo_shim_status* st) {
  st->code = GLOO_SHIM_OK;
  st->peer = -1;
  st->message[0] = '\0';
  return GLOO_SHIM_OK;
}

int32_t fail(gloo_shim_status* st, int32_t code, const std::string& msg) {
  st->code = code;
  st->peer = -1;
  set_message(st, msg);
  return code;
}

bool contains(const std::string& s, const char* needle) {
  return s.find(needle) != std::string::npos;
}

int32_t classify(const std::string& msg, int32_t fallback) {
  if (contains(msg, "already set") || contains(msg, "File already exists")) {
    return GLOO_SHIM_KEY_EXISTS;
  }
  if (contains(msg, "Timed out waiting") || contains(msg, "Wait timeout") ||
      contains(msg, "Connect timeout") || contains(msg, "Read timeout") ||
      contains(msg, "Write timeout")) {
    return GLOO_SHIM_TIMEOUT;
  }
  return fallback;
}

}  // namespace

// ---- stores that can remove keys ----------------------------------------------------------------
//
// Gloo's Store interface (this version) cannot delete a key. Each store kind is subclassed to
// add `erase`, using only the protected members the Gloo headers declare: the in-memory map of
// HashStore, the key-to-file mapping of FileStore and the Redis connection of RedisStore.

namespace {

class ErasableHashStore : public gloo::rendezvous::HashStore {
 public:
  void erase(const std::string& key) {
    std::lock_guard<std::mutex> lock(m_);
    map_.erase(key);
  }
  void exists(const std::vector<std::string>& keys, std::vector<char>& out) {
    std::lock_guard<std::mutex> lock(m_);
    out.resize(keys.size());
    for (size_t i = 0; i < keys.size(); i++) {
      out[i] = map_.count(keys[i]) != 0;
    }
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(m_);
    return map_.size();
  }
};

class ErasableFileStore : public gloo::rendezvous::FileStore {
 public:
  explicit ErasableFileStore(const std::string& path) : FileStore(path) {}
  void erase(const std::string& key) {
    std::string path = objectPath(key);
    // A missing file is fine (already removed); the remembered path goes either way.
    std::remove(path.c_str());
    keyFilePaths_.erase(
        std::remove(keyFilePaths_.begin(), keyFilePaths_.end(), path), keyFilePaths_.end());
  }
  void exists(const std::vector<std::string>& keys, std::vector<char>& out) {
    out.resize(keys.size());
    for (size_t i = 0; i < keys.size(); i++) {
      out[i] = check({keys[i]});
    }
  }
};

class ErasableRedisStore : public gloo::rendezvous::RedisStore {
 public:
  ErasableRedisStore(const std::string& host, int port) : RedisStore(host, port) {}
  void erase(const std::string& key) {
    void* reply = redisCommand(redis_, "DEL %b", key.data(), key.size());
    if (reply == nullptr) {
      throw std::runtime_error(std::string("redis DEL failed: ") + redis_->errstr);
    }
    freeReplyObject(reply);
  }
  // The failure of a request: a request that ran past the connection's timeout (a stopped
  // or overloaded server) is reported as a timeout.
  [[noreturn]] void io_failure(const char* what) {
    std::string err = redis_->errstr;
    if (redis_->err == REDIS_ERR_IO && contains(err, "temporarily unavailable")) {
      throw gloo::IoException(
          std::string("Timed out waiting for the Redis server (no answer within the time limit: "
                      "it may be stopped or overloaded): ") +
          what + ": " + err);
    }
    throw gloo::IoException(std::string(what) + " failed: " + err);
  }

  // One EXISTS per key, pipelined in batches (one round trip per batch, not per key).
  void exists(const std::vector<std::string>& keys, std::vector<char>& out) {
    constexpr size_t kBatch = 1024;
    out.assign(keys.size(), 0);
    for (size_t begin = 0; begin < keys.size(); begin += kBatch) {
      size_t end = std::min(keys.size(), begin + kBatch);
      for (size_t i = begin; i < end; i++) {
        if (redisAppendCommand(redis_, "EXISTS %b", keys[i].data(), keys[i].size()) != REDIS_OK) {
          io_failure("redis EXISTS");
        }
      }
      // Every reply of the batch is read, even after an unexpected one, so that the
      // connection stays in step for the next request.
      std::string unexpected;
      for (size_t i = begin; i < end; i++) {
        void* reply = nullptr;
        if (redisGetReply(redis_, &reply) != REDIS_OK || reply == nullptr) {
          io_failure("redis EXISTS");
        }
        auto* r = static_cast<redisReply*>(reply);
        if (r->type == REDIS_REPLY_INTEGER) {
          out[i] = r->integer > 0;
        } else if (unexpected.empty()) {
          unexpected = r->type == REDIS_REPLY_ERROR && r->str != nullptr
              ? std::string(r->str, r->len)
              : "reply of type " + std::to_string(r->type);
        }
        freeReplyObject(reply);
      }
      if (!unexpected.empty()) {
        throw gloo::IoException("redis EXISTS: unexpected reply: " + unexpected);
      }
    }
  }
  // Bounds every later request on this connection (0: no bound). hiredis reports a request
  // that runs past it as an error, which the caller sees as an I/O failure.
  void io_timeout(int64_t ms) {
    struct timeval tv = {};
    if (ms > 0) {
      tv.tv_sec = static_cast<time_t>(ms / 1000);
      tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
    }
    if (redisSetTimeout(redis_, tv) != REDIS_OK) {
      throw gloo::IoException(std::string("redis: cannot set a timeout: ") + redis_->errstr);
    }
  }
};

}  // namespace

struct gloo_shim_store {
  std::shared_ptr<gloo::rendezvous::Store> store;
  // Removes one key (full name) from `store`; captures a pointer kept alive by `store`.
  std::function<void(const std::string&)> erase;
  // Number of keys, where the store can tell (the in-memory store); else null.
  std::function<size_t()> count;
  // Whether each of the keys (full names) exists, without waiting: out[i] != 0 if keys[i] does.
  std::function<void(const std::vector<std::string>&, std::vector<char>&)> exists;
  // Bounds each request to a store server in milliseconds (0: no bound); null for the stores
  // that need none (in memory, files).
  std::function<void(int64_t)> io_timeout;
};

// ---- the transport loop's tick ------------------------------------------------------------------
//
// Gloo's TCP device runs one event loop thread (epoll_wait with a 10 ms timeout). Taking a
// descriptor out of the loop from another thread (tcp::Loop::unregisterDescriptor) waits for the
// loop's next tick, so that the descriptor's handler is never called afterwards: up to 10 ms
// while the loop is idle. A pair does that when it connects as the client (it drops its
// listening socket) and when it is destroyed, so every rendezvous and every communicator's end
// cost about 10 ms each (measured: 10.3-14 ms per group creation on 2 ranks in one process, all
// of it in the client's connect).
//
// A Waker is an eventfd in the loop (level triggered, counting as a semaphore). While a Spin
// holds it, its count is positive, so epoll_wait returns at once and the loop ticks every 20 us
// (its handler pauses that long per tick): a wait for a tick ends within tens of microseconds.
// Without the pause the loop would spin, and with many ranks on few cores the spinning loops
// took the CPU from the ranks (measured, 8 ranks as threads on 2 cores: 22 ms per group
// creation spinning, 3.5 ms ticking every 20 us, 32 ms without a Waker; 10 us and 100 us ticks
// gave 3.4 and 4.2 ms). Spins are held only around the calls that wait for a tick (the
// connects of a rendezvous, destroying a context), which take microseconds on a healthy
// connection; a connect to a host that does not answer can wait much longer, so after 2 ms
// the pause grows with the time spun, up to 1 ms (still ten times the idle loop's rate).
// Best effort: without an eventfd (or a TCP device) there is no Waker, and those calls take
// their 10 ms as in Gloo.
class Waker final : public gloo::transport::tcp::Handler {
 public:
  // The device's Waker, or null when one cannot be made.
  static std::shared_ptr<Waker> make(std::shared_ptr<gloo::transport::Device> device) {
    auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device.get());
    if (tcp == nullptr) {
      return nullptr;
    }
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE);
    if (fd < 0) {
      return nullptr;
    }
    std::shared_ptr<Waker> w(new Waker(std::move(device), tcp, fd));
    try {
      tcp->registerDescriptor(fd, EPOLLIN, w.get());
    } catch (...) {
      w->tcp_ = nullptr;  // not registered: the destructor only closes the descriptor
      return nullptr;
    }
    return w;
  }

  ~Waker() override {
    if (tcp_ != nullptr) {
      try {
        tcp_->unregisterDescriptor(fd_, this);  // one tick (the handler is never called after)
      } catch (...) {
      }
    }
    ::close(fd_);
  }

  // The loop's call while the count is positive (the Spins and Yielding windows own the
  // count). In a Yielding window: give the core away, after 2 ms pause 20 us. Otherwise (a
  // Spin): a pause of 20 us, after 2 ms of spinning a quarter of the time spun, at most 1 ms.
  void handleEvents(int /*events*/) override {
    if (yielding_.load(std::memory_order_relaxed) > 0) {
      // A rank that waits long inside a collective (its peers are late) should not keep a
      // core: after 2 ms of one window, 20 us pauses (measured: a 3 s wait in a broadcast
      // took 3.0 s of CPU yielding only, 0.6 s so; an 8 MiB broadcast at 4 ranks 5.3 ms
      // either way, 6.1 ms pausing from the start).
      constexpr int64_t kYieldOnly = 2000000;
      constexpr int64_t kPause = 20000;
      if (now_ns() - yield_since_ns_.load(std::memory_order_relaxed) <= kYieldOnly) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::nanoseconds(kPause));
      }
      return;
    }
    if (active_.load(std::memory_order_relaxed) == 0) {
      return;
    }
    const int64_t spun = now_ns() - since_ns_.load(std::memory_order_relaxed);
    constexpr int64_t kTick = 20000;
    constexpr int64_t kShort = 2000000;
    const int64_t pause = spun <= kShort ? kTick : std::min<int64_t>(spun / 4, 1000000);
    std::this_thread::sleep_for(std::chrono::nanoseconds(pause));
  }

  // A Spin begins and ends.
  void up() {
    if (active_.fetch_add(1, std::memory_order_relaxed) == 0) {
      since_ns_.store(now_ns(), std::memory_order_relaxed);
    }
    post();
  }

  void down() {
    take();
    active_.fetch_sub(1, std::memory_order_relaxed);
  }

  // A Yielding window begins and ends.
  void yield_up() {
    if (yielding_.fetch_add(1, std::memory_order_relaxed) == 0) {
      yield_since_ns_.store(now_ns(), std::memory_order_relaxed);
    }
    post();
  }

  void yield_down() {
    take();
    yielding_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  Waker(std::shared_ptr<gloo::transport::Device> device, gloo::transport::tcp::Device* tcp, int fd)
      : device_(std::move(device)), tcp_(tcp), fd_(fd) {}

  // One more (post) or one less (take) on the eventfd's count: readable while positive.
  void post() {
    uint64_t one = 1;
    ssize_t rv;
    do {
      rv = ::write(fd_, &one, sizeof(one));
    } while (rv < 0 && errno == EINTR);
  }

  void take() {
    uint64_t v = 0;
    ssize_t rv;
    do {
      rv = ::read(fd_, &v, sizeof(v));
    } while (rv < 0 && errno == EINTR);
  }

  // Keeps the device, and with it the loop, alive as long as the descriptor is registered.
  std::shared_ptr<gloo::transport::Device> device_;
  gloo::transport::tcp::Device* tcp_;
  int fd_;
  // Spins alive, and when the first of them began (for the handler's pause).
  std::atomic<int> active_{0};
  std::atomic<int64_t> since_ns_{0};
  // Yielding windows open (see Yielding), and when the first of them opened.
  std::atomic<int> yielding_{0};
  std::atomic<int64_t> yield_since_ns_{0};
};

// Holds a Waker in one of its two modes while alive (Begin on construction, End on
// destruction); nothing when there is no Waker.
template <void (Waker::*Begin)(), void (Waker::*End)()>
class WakerWindow {
 public:
  explicit WakerWindow(Waker* w) : w_(w) {
    if (w_ != nullptr) {
      (w_->*Begin)();
    }
  }
  ~WakerWindow() {
    if (w_ != nullptr) {
      (w_->*End)();
    }
  }
  WakerWindow(const WakerWindow&) = delete;
  WakerWindow& operator=(const WakerWindow&) = delete;

 private:
  Waker* w_;
};

// Keeps the loop ticking while alive.
using Spin = WakerWindow<&Waker::up, &Waker::down>;

// While alive, the loop gives its core away (sched_yield) on every tick instead of sleeping in
// epoll_wait, and after 2 ms pauses 20 us per tick. Held by a user thread around the calls that
// take a pair's lock: posting Gloo sends and receives, and, unless busy polling is off, each of
// libgloo's collectives. The loop's handler for a pair only try-locks it (tcp::Pair::handleEvents):
// when data arrives on a pair whose lock a user thread holds, the handler returns at once and, with
// the event still pending, so does epoll_wait: the loop spins. If the loop's wake-up took the core
// from that user thread, the lock is not released before the scheduler's next tick (4 ms on these
// machines). Yielding gives the core back to the holder. Measured, 4 ranks as threads on 2 cores,
// 8-byte broadcast and all-reduce of one round of messages: 10.9 million epoll_wait calls in a run
// whose median call took 4.0 ms without, 22 thousand and 0.26-0.31 ms with.
using Yielding = WakerWindow<&Waker::yield_up, &Waker::yield_down>;

struct gloo_shim_device {
  std::shared_ptr<gloo::transport::Device> device;
  // Null when it could not be made (see Waker).
  std::shared_ptr<Waker> waker = nullptr;
};

namespace {

// A constructed gloo::ReduceScatterHalvingDoubling<T> with its buffer, kept for reuse.
// Gloo's legacy algorithms are built to be constructed once and run many times: construction
// takes slots, registers pair-bound buffers and allocates two internal buffers of the whole
// input size, which for large inputs costs more than the communication (fresh pages).
struct HdCache {
  virtual ~HdCache() noexcept(false) {}
  virtual void run(const void* send, void* recv) = 0;
  int32_t dtype = -1;
  int32_t op = -1;
  size_t recv_count = 0;
};

}  // namespace

// The point-to-point waits in progress on one context, so that an abort can wake them
// (UnboundBuffer::abortWaitRecv/abortWaitSend); shared with posted operations, which may
// outlive the context's handle.
struct P2pWaits {
  std::mutex mu;
  bool aborted = false;
  // Each waiting buffer and whether it waits for a receive.
  std::vector<std::pair<gloo::transport::UnboundBuffer*, bool>> waiting;
};

// The exception of a wait woken by an abort (reported as GLOO_SHIM_ABORTED).
struct P2pAborted : std::runtime_error {
  P2pAborted()
      : std::runtime_error(
            "the communicator was aborted on this rank while a point-to-point operation waited") {}
};

// The staging memory of a context's point-to-point transfers (see P2pTransfer), kept from one
// operation to the next. Every transfer stages its header, and an inline payload, through one
// block of up to kHeader + GLOO_SHIM_FRAME_HEAD_MAX + the check slots' inline limit (about
// 64 KiB). Allocated and freed per operation, these blocks let glibc trim the heap after every
// round of messages and fault its pages back in on the next round (measured, 2 ranks as threads,
// all-reduce of 128 KiB as two rounds: about 60 page faults per call and rank, 547 us a call
// against 178 us for libgloo's ring; see docs/performance.md). Every block has the same size;
// at most `kept` blocks wait here (2 for each peer: a round posts one send and one receive per
// peer), the rest are freed. Thread-safe.
class StagingPool {
 public:
  StagingPool(size_t block, size_t kept) : block_(block), kept_(kept) {}

  // A block of block() bytes (contents undefined).
  std::unique_ptr<char[]> take() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!free_.empty()) {
        std::unique_ptr<char[]> b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
    }
    return std::unique_ptr<char[]>(new char[block_]);
  }

  // Returns a block from take() once nothing touches it any more.
  void give(std::unique_ptr<char[]> b) noexcept {
    if (!b) {
      return;
    }
    std::lock_guard<std::mutex> g(mu_);
    if (free_.size() < kept_) {
      try {
        free_.push_back(std::move(b));
      } catch (...) {
        // No room to keep it: `b` frees the block.
      }
    }
  }

  size_t block() const { return block_; }

 private:
  const size_t block_;
  const size_t kept_;
  std::mutex mu_;
  std::vector<std::unique_ptr<char[]>> free_;
};

// One block of a StagingPool, given back when destroyed.
class PooledBlock {
 public:
  PooledBlock() = default;
  PooledBlock(const PooledBlock&) = delete;
  PooledBlock& operator=(const PooledBlock&) = delete;
  ~PooledBlock() { release(); }

  // Takes a block of at least `bytes` bytes: from `pool` when its blocks are large enough
  // (always, for the transfers' staging), otherwise a block of its own.
  void reset(const std::shared_ptr<StagingPool>& pool, size_t bytes) {
    release();
    if (pool && bytes <= pool->block()) {
      pool_ = pool;
      mem_ = pool->take();
    } else {
      mem_.reset(new char[bytes]);
    }
  }

  char* get() const { return mem_.get(); }

 private:
  void release() noexcept {
    if (pool_) {
      pool_->give(std::move(mem_));
      pool_.reset();
    }
    mem_.reset();
  }

  std::shared_ptr<StagingPool> pool_;
  std::unique_ptr<char[]> mem_;
};

struct gloo_shim_context {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  // Serialises the legacy (pair-bound) algorithms, which take slots from the context's
  // non-atomic slot counter (gloo::Context::nextSlot), and guards `hd`.
  std::mutex legacy;
  // The last reduce-scatter, reused when the next one has the same dtype, reduction and size.
  // Every rank makes the same calls in the same order, so every rank makes the same decision
  // (and takes the same slots). Owned; deleted before `ctx` (see drop_hd).
  HdCache* hd = nullptr;
  // Sequence number of the next large point-to-point message sent from this context: names its
  // payload slot (see the length protocol in gloo_shim.h).
  std::atomic<uint64_t> p2p_seq{0};
  // Point-to-point waits in progress, for gloo_shim_context_abort_waits.
  std::shared_ptr<P2pWaits> waits = std::make_shared<P2pWaits>();
  // The device's Waker (may be null): the context's pairs are destroyed under a Spin.
  std::shared_ptr<Waker> waker = nullptr;
  // Whether libgloo's collectives run inside a Yielding window (gloo_shim_context_set_busy_poll).
  std::atomic<bool> busy_poll{true};
  // Only those of fewer bytes than this do (gloo_shim_context_set_busy_poll_below).
  std::atomic<size_t> busy_poll_below{SIZE_MAX};
  // The staging blocks of this context's point-to-point transfers (made with the context).
  std::shared_ptr<StagingPool> staging = nullptr;
};

namespace {

void drop_hd(gloo_shim_context* c) {
  HdCache* h = c->hd;
  c->hd = nullptr;
  delete h;  // may throw (gloo::Algorithm's destructor is noexcept(false)); callers catch
}

}  // namespace

namespace {

// Slot prefix of the zero-byte probes sent by probe_peers (never received by anyone).
constexpr uint8_t kProbeSlotPrefix = 0x7B;

// Fills st->peer with the first peer whose connection failed on its own (not as a consequence
// of a local timeout) and appends every broken connection to the message.
//
// A TCP pair that failed keeps its exception and rethrows it from every later operation
// (tcp::Pair::send calls throwIfException under the pair lock), so posting a zero-byte send to
// each peer reveals which connections are broken, with the message of their first failure,
// using only Gloo's public interface. On a healthy connection the probe posts a harmless
// notification on a slot nobody receives on; the buffer is destroyed (the send cancelled) at
// once. The communicator is unusable after a failure anyway.
void probe_peers(gloo::Context* ctx, gloo_shim_status* st) {
  if (ctx == nullptr) {
    return;
  }
  std::string all;
  int32_t first = -1;
  for (int i = 0; i < ctx->size; i++) {
    if (i == ctx->rank) {
      continue;
    }
    std::string msg;
    try {
      auto buf = ctx->createUnboundBuffer(nullptr, 0);
      buf->send(i, gloo::Slot::build(kProbeSlotPrefix, 0), 0, 0);
      continue;  // healthy
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      continue;
    }
    if (contains(msg, kSecondaryFailure)) {
      continue;
    }
    if (first < 0) {
      first = i;
    }
    all += (all.empty() ? "" : "; ") + std::string("rank ") + std::to_string(i) + ": " + msg;
  }
  if (first >= 0) {
    st->peer = first;
    std::string msg = st->message;
    msg += " [broken connections: " + all + "]";
    set_message(st, msg);
  }
}

// Runs f, turning every exception into a status. On a communication failure the pairs of ctx
// are probed for the failed peer.
template <typename F>
int32_t guarded(gloo::Context* ctx, gloo_shim_status* st, F&& f) {
  ok(st);
  int32_t code = GLOO_SHIM_OK;
  try {
    f();
    return GLOO_SHIM_OK;
  } catch (const P2pAborted& e) {
    return fail(st, GLOO_SHIM_ABORTED, e.what());
  } catch (const gloo::IoException& e) {
    code = fail(st, classify(e.what(), GLOO_SHIM_IO), e.what());
  } catch (const gloo::EnforceNotMet& e) {
    code = fail(st, classify(e.what(), GLOO_SHIM_ENFORCE), e.what());
  } catch (const gloo::Exception& e) {
    code = fail(st, classify(e.what(), GLOO_SHIM_OTHER), e.what());
  } catch (const std::exception& e) {
    code = fail(st, classify(e.what(), GLOO_SHIM_OTHER), e.what());
  } catch (...) {
    code = fail(st, GLOO_SHIM_OTHER, "unknown C++ exception");
  }
  if (code == GLOO_SHIM_IO || code == GLOO_SHIM_TIMEOUT) {
    try {
      probe_peers(ctx, st);
    } catch (...) {
    }
  }
  return code;
}

Millis to_millis(int64_t ms) {
  return Millis(ms > 0 ? ms : 1);
}

// A store view whose every wait (including the implicit wait of get) is bounded by one
// timeout. Gloo's rendezvous calls Store::get without a timeout (30 s by default); this makes
// the configured timeout apply to the whole rendezvous.
class BoundedStore : public gloo::rendezvous::Store {
 public:
  BoundedStore(std::shared_ptr<gloo::rendezvous::Store> base, Millis timeout)
      : base_(std::move(base)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    base_->set(key, data);
  }

  std::vector<char> get(const std::string& key) override {
    base_->wait({key}, timeout_);
    return base_->get(key);
  }

  void wait(const std::vector<std::string>& keys) override {
    base_->wait(keys, timeout_);
  }

  void wait(const std::vector<std::string>& keys, const Millis& timeout) override {
    Millis t = (timeout == gloo::kNoTimeout) ? timeout_ : std::min(timeout, timeout_);
    base_->wait(keys, t);
  }

 private:
  std::shared_ptr<gloo::rendezvous::Store> base_;
  Millis timeout_;
};

// ---- element types and reductions --------------------------------------------------------------
//
// The shim does no arithmetic of its own: every element-wise reduction Gloo performs calls the
// caller's gloo_shim_reduce_fn (backend-gloo passes grid_core's host kernels). The C++ types
// below only give Gloo's templates the element size (f16 and bf16 are two opaque bytes).

struct f16_t {
  uint16_t x;
};
struct bf16_t {
  uint16_t x;
};
struct bool_t {
  uint8_t x;
};
struct f8e4m3_t {
  uint8_t x;
};
struct f8e5m2_t {
  uint8_t x;
};

template <typename T>
struct DtypeOf;
template <>
struct DtypeOf<float> {
  static constexpr int32_t value = GLOO_SHIM_F32;
};
template <>
struct DtypeOf<double> {
  static constexpr int32_t value = GLOO_SHIM_F64;
};
template <>
struct DtypeOf<int32_t> {
  static constexpr int32_t value = GLOO_SHIM_I32;
};
template <>
struct DtypeOf<int64_t> {
  static constexpr int32_t value = GLOO_SHIM_I64;
};
template <>
struct DtypeOf<uint8_t> {
  static constexpr int32_t value = GLOO_SHIM_U8;
};
template <>
struct DtypeOf<f16_t> {
  static constexpr int32_t value = GLOO_SHIM_F16;
};
template <>
struct DtypeOf<bf16_t> {
  static constexpr int32_t value = GLOO_SHIM_BF16;
};
template <>
struct DtypeOf<int8_t> {
  static constexpr int32_t value = GLOO_SHIM_I8;
};
template <>
struct DtypeOf<uint32_t> {
  static constexpr int32_t value = GLOO_SHIM_U32;
};
template <>
struct DtypeOf<uint64_t> {
  static constexpr int32_t value = GLOO_SHIM_U64;
};
template <>
struct DtypeOf<bool_t> {
  static constexpr int32_t value = GLOO_SHIM_BOOL;
};
template <>
struct DtypeOf<f8e4m3_t> {
  static constexpr int32_t value = GLOO_SHIM_F8E4M3;
};
template <>
struct DtypeOf<f8e5m2_t> {
  static constexpr int32_t value = GLOO_SHIM_F8E5M2;
};

// The reduction function of the legacy algorithm (gloo::ReductionFunction<T> takes a plain
// function pointer, so the caller's function reaches it through this variable, set on the
// calling thread before every construction and run: the algorithm reduces on that thread).
thread_local gloo_shim_reduce_fn t_legacy_reduce = nullptr;

// The gloo::ReductionFunction<T>::Function form: x = x op y.
template <typename T, int32_t Op>
void legacy_reduce(T* x, const T* y, size_t n) {
  gloo_shim_reduce_fn f = t_legacy_reduce;
  if (f == nullptr) {
    throw std::logic_error("gloo_shim: no reduction function on this thread");
  }
  f(DtypeOf<T>::value, Op, x, x, y, n);
}

template <typename T>
const gloo::ReductionFunction<T>* reduction_function(int32_t op) {
  static const gloo::ReductionFunction<T> sum(gloo::SUM, &legacy_reduce<T, GLOO_SHIM_SUM>);
  static const gloo::ReductionFunction<T> prod(
      gloo::PRODUCT, &legacy_reduce<T, GLOO_SHIM_PROD>);
  static const gloo::ReductionFunction<T> min(gloo::MIN, &legacy_reduce<T, GLOO_SHIM_MIN>);
  static const gloo::ReductionFunction<T> max(gloo::MAX, &legacy_reduce<T, GLOO_SHIM_MAX>);
  switch (op) {
    case GLOO_SHIM_SUM:
      return &sum;
    case GLOO_SHIM_PROD:
      return &prod;
    case GLOO_SHIM_MIN:
      return &min;
    default:
      return &max;
  }
}

bool valid_dtype(int32_t d) {
  return d >= GLOO_SHIM_F32 && d <= GLOO_SHIM_F8E5M2;
}
bool valid_op(int32_t op) {
  return op >= GLOO_SHIM_SUM && op <= GLOO_SHIM_MAX;
}

// Calls f.template operator()<T>() with T the C++ type of dtype.
template <typename F>
void with_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case GLOO_SHIM_F32:
      f(float{});
      break;
    case GLOO_SHIM_F64:
      f(double{});
      break;
    case GLOO_SHIM_I32:
      f(int32_t{});
      break;
    case GLOO_SHIM_I64:
      f(int64_t{});
      break;
    case GLOO_SHIM_U8:
      f(uint8_t{});
      break;
    case GLOO_SHIM_F16:
      f(f16_t{});
      break;
    case GLOO_SHIM_BF16:
      f(bf16_t{});
      break;
    case GLOO_SHIM_I8:
      f(int8_t{});
      break;
    case GLOO_SHIM_U32:
      f(uint32_t{});
      break;
    case GLOO_SHIM_U64:
      f(uint64_t{});
      break;
    case GLOO_SHIM_BOOL:
      f(bool_t{});
      break;
    case GLOO_SHIM_F8E4M3:
      f(f8e4m3_t{});
      break;
    case GLOO_SHIM_F8E5M2:
      f(f8e5m2_t{});
      break;
    default:
      throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
  }
}

template <typename T>
void run_allreduce(
    const std::shared_ptr<gloo::Context>& ctx, const void* send, void* recv, size_t count,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, size_t max_segment_bytes,
    uint32_t tag, Millis timeout) {
  gloo::AllreduceOptions opts(ctx);
  if (send != recv) {
    // Without an input Gloo reduces the output buffer in place.
    opts.setInput(const_cast<T*>(static_cast<const T*>(send)), count);
  }
  opts.setOutput(static_cast<T*>(recv), count);
  const int32_t dtype = DtypeOf<T>::value;
  opts.setReduceFunction([reduce, dtype, op](void* c, const void* a, const void* b, size_t n) {
    reduce(dtype, op, c, a, b, n);
  });
  opts.setAlgorithm(
      algorithm == GLOO_SHIM_ALLREDUCE_BCUBE ? gloo::AllreduceOptions::Algorithm::BCUBE
                                             : gloo::AllreduceOptions::Algorithm::RING);
  if (max_segment_bytes != 0) {
    // The ring's largest segment (Gloo's default: 1 MiB); Gloo rounds it to whole elements.
    opts.setMaxSegmentSize(max_segment_bytes);
  }
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

template <typename T>
struct HdImpl : HdCache {
  std::vector<T> scratch;
  gloo::ReduceScatterHalvingDoubling<T>* algo = nullptr;

  HdImpl(const std::shared_ptr<gloo::Context>& ctx, size_t count, int32_t op_) {
    const size_t size = static_cast<size_t>(ctx->size);
    scratch.resize(count * size);
    std::vector<T*> ptrs{scratch.data()};
    std::vector<int> counts(size, static_cast<int>(count));
    algo = new gloo::ReduceScatterHalvingDoubling<T>(
        ctx, ptrs, static_cast<int>(count * size), counts, reduction_function<T>(op_));
    recv_count = count;
    op = op_;
  }

  ~HdImpl() noexcept(false) override {
    delete algo;
  }

  void run(const void* send, void* recv) override {
    std::memcpy(scratch.data(), send, scratch.size() * sizeof(T));
    algo->run();
    // The algorithm leaves this rank's block at the START of the buffer (not at rank * count).
    std::memcpy(recv, scratch.data(), recv_count * sizeof(T));
  }
};

template <typename T>
void run_reduce_scatter_hd(
    gloo_shim_context* c, const void* send, void* recv, size_t recv_count, int32_t dtype,
    int32_t op, gloo_shim_reduce_fn reduce) {
  std::lock_guard<std::mutex> guard(c->legacy);
  t_legacy_reduce = reduce;
  try {
    if (c->hd == nullptr || c->hd->dtype != dtype || c->hd->op != op ||
        c->hd->recv_count != recv_count) {
      drop_hd(c);
      auto* h = new HdImpl<T>(c->ctx, recv_count, op);
      h->dtype = dtype;
      c->hd = h;
    }
    c->hd->run(send, recv);
  } catch (...) {
    // After a failure the algorithm's state is unknown: never reuse it.
    try {
      drop_hd(c);
    } catch (...) {
    }
    throw;
  }
}

template <typename T>
void run_reduce_scatter_ar(
    gloo_shim_context* c, const void* send, void* recv, size_t recv_count, int32_t op,
    gloo_shim_reduce_fn reduce, int32_t allreduce_algorithm, size_t max_segment_bytes,
    uint32_t tag, Millis timeout) {
  const size_t size = static_cast<size_t>(c->ctx->size);
  // Not value-initialised (no memset of the whole buffer): the all-reduce writes every element.
  std::unique_ptr<T[]> scratch(new T[recv_count * size]);
  run_allreduce<T>(
      c->ctx, send, scratch.get(), recv_count * size, op, reduce, allreduce_algorithm,
      max_segment_bytes, tag, timeout);
  std::memcpy(
      recv, scratch.get() + static_cast<size_t>(c->ctx->rank) * recv_count,
      recv_count * sizeof(T));
}

// Slot prefix of the ring reduce-scatter's messages (one slot per call: its tag).
constexpr uint8_t kRingRsSlotPrefix = 0x7E;

// Ring reduce-scatter: n - 1 steps; at step s this rank sends the partial sum of block
// (rank - s - 1) mod n to rank + 1 and receives that of block (rank - s - 2) mod n from
// rank - 1, which it combines with its own block; the last block it receives is its own, whose
// sum goes straight into recv. Each rank sends (n - 1) blocks: half the traffic of an
// all-reduce, and no scratch buffer of the whole input (two blocks of staging).
template <typename T>
void run_reduce_scatter_ring(
    gloo_shim_context* c, const void* send, void* recv, size_t recv_count, int32_t op,
    gloo_shim_reduce_fn reduce, uint32_t tag, Millis timeout) {
  const auto& ctx = c->ctx;
  const size_t n = static_cast<size_t>(ctx->size);
  const size_t rank = static_cast<size_t>(ctx->rank);
  const size_t block = recv_count * sizeof(T);
  const auto* in = static_cast<const uint8_t*>(send);
  if (n == 1) {
    std::memcpy(recv, in, block);
    return;
  }
  const int32_t dtype = DtypeOf<T>::value;
  const int next = static_cast<int>((rank + 1) % n);
  const int prev = static_cast<int>((rank + n - 1) % n);
  const auto slot = gloo::Slot::build(kRingRsSlotPrefix, tag);
  // Gloo only reads a buffer it sends from.
  auto in_buf = ctx->createUnboundBuffer(const_cast<uint8_t*>(in), block * n);
  std::unique_ptr<T[]> staging(new T[recv_count * 2]);
  auto* stage = reinterpret_cast<uint8_t*>(staging.get());
  auto stage_buf = ctx->createUnboundBuffer(stage, block * 2);
  auto wait = [](bool done) {
    if (!done) {
      throw gloo::IoException("the ring reduce-scatter was aborted");
    }
  };
  for (size_t s = 0; s + 1 < n; s++) {
    const size_t send_block = (rank + 2 * n - s - 1) % n;
    const size_t recv_block = (rank + 2 * n - s - 2) % n;
    const size_t here = (s % 2) * block;
    stage_buf->recv(prev, slot, here, block);
    if (s == 0) {
      in_buf->send(next, slot, send_block * block, block);
      wait(in_buf->waitSend(timeout));
    } else {
      // The partial sum of send_block was reduced into the other half at the previous step.
      stage_buf->send(next, slot, ((s + 1) % 2) * block, block);
      wait(stage_buf->waitSend(timeout));
    }
    wait(stage_buf->waitRecv(timeout));
    void* out = (s + 2 == n) ? recv : static_cast<void*>(stage + here);
    reduce(dtype, op, out, stage + here, in + recv_block * block, recv_count);
  }
}

// ---- point to point: the length protocol (described in gloo_shim.h) ---------------------------

// "GRDP": the first four bytes of every point-to-point header.
constexpr uint32_t kP2pMagic = 0x50445247u;
constexpr size_t kInlineMax = GLOO_SHIM_P2P_INLINE_MAX;
// The mismatch check's messages carry a fingerprint before up to kInlineMax bytes of payload
// (backend-gloo's one-round collectives), so that a 64 KiB collective still travels in one
// message.
constexpr size_t kCheckInlineMax = GLOO_SHIM_P2P_INLINE_MAX + GLOO_SHIM_CHECK_INLINE_EXTRA;
constexpr size_t kChunk = GLOO_SHIM_P2P_CHUNK;
constexpr size_t kFrameMax = GLOO_SHIM_FRAME_HEAD_MAX;
// The largest chunk size a receiver accepts from a header (a sanity bound, far above kChunk).
constexpr uint64_t kMaxChunk = uint64_t(1) << 30;

// Payload bytes copied through staging or scratch memory (gloo_shim_p2p_copied_bytes).
std::atomic<uint64_t> g_p2p_copied{0};

struct P2pHeader {
  uint32_t magic;
  int32_t dtype;
  uint64_t count;
  uint64_t bytes;
  // 0: the payload follows the header in the same message. Otherwise the payload comes in
  // chunks of this many bytes (the last one shorter) on payload slot `seq`.
  uint64_t chunk;
  uint64_t seq;
  // Bytes of the caller's header (a framed message) right after this one; 0: none.
  uint64_t frame;
};
static_assert(sizeof(P2pHeader) == 48, "the header is 48 bytes on every rank");
constexpr size_t kHeader = sizeof(P2pHeader);

// The receiver's answer to a chunked message: whether it matched, and what the receive posted.
struct P2pReply {
  uint32_t magic;
  int32_t mismatch;
  int32_t dtype;
  // The header length the receive posted (framed messages; 0: a plain receive).
  uint32_t head;
  uint64_t count;
};
static_assert(sizeof(P2pReply) == 24, "the answer is 24 bytes on every rank");

size_t dtype_size(int32_t d) {
  switch (d) {
    case GLOO_SHIM_F32:
    case GLOO_SHIM_I32:
    case GLOO_SHIM_U32:
      return 4;
    case GLOO_SHIM_F64:
    case GLOO_SHIM_I64:
    case GLOO_SHIM_U64:
      return 8;
    case GLOO_SHIM_U8:
    case GLOO_SHIM_I8:
    case GLOO_SHIM_BOOL:
    case GLOO_SHIM_F8E4M3:
    case GLOO_SHIM_F8E5M2:
      return 1;
    case GLOO_SHIM_F16:
    case GLOO_SHIM_BF16:
      return 2;
    default:
      return 0;
  }
}

// prefix: kP2pSlotPrefix (user messages), kCollSlotPrefix (gloo_shim_exchange) or
// kCheckSlotPrefix (gloo_shim_check_exchange).
uint64_t header_slot(uint8_t prefix, uint32_t tag) {
  return gloo::Slot::build(prefix, tag);
}

uint64_t payload_slot(uint64_t seq) {
  return (uint64_t(kP2pPayloadPrefix) << 56) | (seq & ((uint64_t(1) << 56) - 1));
}

uint64_t reply_slot(uint64_t seq) {
  return (uint64_t(kP2pReplyPrefix) << 56) | (seq & ((uint64_t(1) << 56) - 1));
}

void check_peer(const gloo::Context& ctx, int32_t peer) {
  if (peer < 0 || peer >= ctx.size || peer == ctx.rank) {
    throw std::invalid_argument(
        "peer " + std::to_string(peer) + " is not another rank of this context (rank " +
        std::to_string(ctx.rank) + " of " + std::to_string(ctx.size) + ")");
  }
}

void check_op(const gloo::Context& ctx, const gloo_shim_p2p_op& op) {
  check_peer(ctx, op.peer);
  size_t width = dtype_size(op.dtype);
  if (width == 0) {
    throw std::invalid_argument("unknown dtype " + std::to_string(op.dtype));
  }
  if (op.count > std::numeric_limits<size_t>::max() / width || op.count * width != op.bytes) {
    throw std::invalid_argument(
        "buffer of " + std::to_string(op.bytes) + " bytes does not hold " +
        std::to_string(op.count) + " elements of " + std::to_string(width) + " bytes");
  }
  if (op.bytes > 0 && op.ptr == nullptr) {
    throw std::invalid_argument("null buffer of " + std::to_string(op.bytes) + " bytes");
  }
  if (op.head_bytes > kFrameMax) {
    throw std::invalid_argument(
        "a framed message's header of " + std::to_string(op.head_bytes) +
        " bytes is longer than " + std::to_string(kFrameMax) + " bytes");
  }
  if (op.head_bytes > 0 && op.head == nullptr) {
    throw std::invalid_argument("null header of " + std::to_string(op.head_bytes) + " bytes");
  }
}

// A protocol violation: a message on a point-to-point slot that this shim did not make (or a
// header that does not describe itself consistently). The connection's state is unknown
// afterwards, so this is a failure of the communicator, not a mismatch.
[[noreturn]] void protocol_error(const gloo_shim_p2p_op& op, const std::string& what) {
  throw std::runtime_error(
      "point-to-point protocol violation in a message from rank " + std::to_string(op.peer) +
      " with tag " + std::to_string(op.tag) + ": " + what +
      " (every rank must run the same version of this library)");
}

Millis remaining(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? left : Millis(1);
}

// ---- rendezvous with one deadline -------------------------------------------------------------
//
// Gloo's connectFullMesh waits for each peer's key in turn and, on the listening side of a TCP
// pair, for the peer's connection up to 5 x the timeout; it creates every pair (one listening
// socket each) before it knows whether the other ranks exist, and it cannot say who is missing.
// This rendezvous does the same work with Gloo's public transport interface, in phases that
// all share one deadline:
//   A. arrival (a world only): set a<rank> (this host's name), wait for a<i> of every rank.
//      Nothing that grows with the world size is created before every rank has arrived, so a
//      mistyped, far too large world size fails at the deadline, listing the ranks that never
//      arrived. A group of a connected communicator has no size to doubt and skips it.
//   B. pairs: create one pair per peer and set <rank> = this host's name and every pair's
//      address (Gloo's layout).
//   C. wait for <i> of every peer (the host names give this rank's local rank), then connect
//      every pair on which this rank is the client (the side Gloo picks by comparing
//      addresses): quick, or refused at once by a dead peer.
//   D. set c<rank>, wait for c<j> of every peer that connects to this rank, then complete those
//      pairs (their connections are already made: no wait of 5 x the timeout on a dead peer).
//   E. a barrier over the new context (every member completed its connections).
// A rank that fails after arriving writes the key `failed` (who failed, whom it blames, why),
// and every rank still waiting in the store fails at once with that cause instead of waiting
// for the deadline. The store is polled every 1-10 ms.

// A rendezvous failure: status code, the communicator rank blamed (-1: none) and the message.
struct RdvError : std::runtime_error {
  int32_t code;
  int32_t peer;
  // True when the failure was another rank's, read from the store (not announced again).
  bool relayed;
  RdvError(int32_t c, int32_t p, const std::string& m, bool r = false)
      : std::runtime_error(m), code(c), peer(p), relayed(r) {}
};

// Ascending ranks: an explicit list, or [lo, hi) without `skip` (no list is built, so a huge
// world size costs nothing until its ranks exist).
struct RankSet {
  const std::vector<int>* list = nullptr;
  int lo = 0;
  int hi = 0;
  int skip = -1;
  size_t count() const {
    if (list != nullptr) {
      return list->size();
    }
    size_t n = hi > lo ? static_cast<size_t>(hi - lo) : 0;
    return (skip >= lo && skip < hi) ? n - 1 : n;
  }
  int at(size_t i) const {
    if (list != nullptr) {
      return (*list)[i];
    }
    int r = lo + static_cast<int>(i);
    return (skip >= lo && r >= skip) ? r + 1 : r;
  }
};

// A gloo::rendezvous::Context whose transport context is built by this rendezvous (Gloo's
// connectFullMesh sets the same two protected members).
class MeshContext : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  void adopt(
      std::shared_ptr<gloo::transport::Device> dev,
      std::shared_ptr<gloo::transport::Context> tc) {
    device_ = std::move(dev);
    transportContext_ = std::move(tc);
  }
};

// "ranks 2, 5-7, 9": ascending ranks as ranges, at most `max_items` items, then "... (N more)".
std::string rank_list(const std::vector<int>& ranks, size_t max_items = 12) {
  std::string out;
  size_t items = 0;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) {
      j++;
    }
    if (items == max_items) {
      out += ", ... (" + std::to_string(ranks.size() - i) + " more)";
      break;
    }
    out += (items == 0 ? "" : ", ") + std::to_string(ranks[i]);
    if (j > i) {
      out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    }
    items++;
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

std::string plural(size_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

class Rendezvous {
 public:
  Rendezvous(gloo_shim_store* store, std::string prefix, int rank, int size, Millis timeout)
      : store_(store),
        prefix_(std::move(prefix)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        end_(std::chrono::steady_clock::now() + timeout) {}

  std::string key(const char* kind, int r) const {
    return prefix_ + "/" + kind + std::to_string(r);
  }

  Millis left() const {
    auto l = std::chrono::duration_cast<Millis>(end_ - std::chrono::steady_clock::now());
    return l.count() > 0 ? l : Millis(0);
  }

  void set(const std::string& k, const std::string& value) {
    bound_io();
    store_->store->set(k, std::vector<char>(value.begin(), value.end()));
    keys_.push_back(k);
  }

  void set(const std::string& k, const std::vector<char>& value) {
    bound_io();
    store_->store->set(k, value);
    keys_.push_back(k);
  }

  // The value of a key known to exist.
  std::vector<char> get(const std::string& k) {
    bound_io();
    BoundedStore bounded(store_->store, Millis(1000));
    return bounded.get(k);
  }

  // Waits until key kind<j> exists for every j of `ranks` (ascending). Throws at the deadline
  // (listing the ranks whose key is missing, `what` says what they did not do) or as soon as
  // another rank announced a failure.
  // `blame`: a single missing rank is the one blamed (not for arrival: a rank that never
  // arrived may not exist at all, when the world size is wrong).
  void wait_all(const RankSet& ranks, const char* kind, const char* what, bool blame) {
    size_t next = 0;
    // Stores that cannot wake a waiter (file, Redis) are polled: first after 50 us, then at
    // 1.5x the previous interval up to 1 ms. A missing key is usually a peer a few hundred
    // microseconds behind; the old 1 ms start doubling to 10 ms left every phase of every
    // group's rendezvous sleeping several ms after its last key arrived (measured: 25 groups at
    // world 8, 4 waits each). A poll is one stat (file) or one round trip (Redis).
    auto sleep = std::chrono::microseconds(50);
    std::vector<std::string> one(1);
    std::vector<char> found;
    while (true) {
      bound_io();
      while (next < ranks.count()) {
        one[0] = key(kind, ranks.at(next));
        store_->exists(one, found);
        if (!found[0]) {
          break;
        }
        next++;
      }
      if (next == ranks.count()) {
        return;
      }
      check_failed();
      if (left().count() == 0) {
        throw_missing(ranks, next, kind, what, blame);
      }
      if (store_->count) {
        // The in-memory store wakes its waiters when a key is set: wait on the next key for
        // up to 10 ms (then look at the failure key again).
        try {
          store_->store->wait({key(kind, ranks.at(next))}, std::max(Millis(1), std::min(left(), Millis(10))));
        } catch (const std::exception&) {
        }
        continue;
      }
      std::this_thread::sleep_for(std::min<std::chrono::microseconds>(sleep, left()));
      sleep = std::min<std::chrono::microseconds>(sleep * 3 / 2, Millis(1));
    }
  }

  // Throws the failure another rank announced, if any.
  void check_failed() {
    std::vector<std::string> k{prefix_ + "/failed"};
    std::vector<char> found;
    store_->exists(k, found);
    if (!found[0]) {
      return;
    }
    auto v = get(k[0]);
    std::string text(v.begin(), v.end());
    // "<reporter> <blamed> <code>\n<message>"
    int reporter = -1, blamed = -1, code = GLOO_SHIM_IO;
    auto nl = text.find('\n');
    std::sscanf(text.substr(0, nl).c_str(), "%d %d %d", &reporter, &blamed, &code);
    std::string msg = nl == std::string::npos ? text : text.substr(nl + 1);
    throw RdvError(
        code, blamed, "rank " + std::to_string(reporter) + " failed during the rendezvous: " + msg,
        true);
  }

  // Announces this rank's failure to the ranks still waiting (best effort, first one wins).
  void announce(int32_t blamed, int32_t code, const std::string& msg) noexcept {
    try {
      bound_io();
      std::string v = std::to_string(rank_) + " " + std::to_string(blamed) + " " +
          std::to_string(code) + "\n" + msg;
      store_->store->set(prefix_ + "/failed", std::vector<char>(v.begin(), v.end()));
    } catch (...) {
    }
  }

  // The ranks among `ranks` whose key kind<r> is missing (checked in batches, at most 2 s).
  std::vector<int> missing(const RankSet& ranks, size_t from, const char* kind, bool* complete) {
    std::vector<int> out;
    std::vector<std::string> keys;
    std::vector<char> found;
    auto stop = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    *complete = true;
    for (size_t begin = from; begin < ranks.count(); begin += 4096) {
      if (std::chrono::steady_clock::now() > stop) {
        *complete = false;
        break;
      }
      size_t end = std::min(ranks.count(), begin + 4096);
      keys.clear();
      for (size_t i = begin; i < end; i++) {
        keys.push_back(key(kind, ranks.at(i)));
      }
      store_->exists(keys, found);
      for (size_t i = begin; i < end; i++) {
        if (!found[i - begin]) {
          out.push_back(ranks.at(i));
        }
      }
    }
    return out;
  }

  [[noreturn]] void throw_missing(
      const RankSet& ranks, size_t from, const char* kind, const char* what, bool blame) {
    bool complete = true;
    auto miss = missing(ranks, from, kind, &complete);
    std::string msg = "rendezvous of " + plural(size_, "rank", "ranks") + " timed out after " +
        std::to_string(timeout_.count()) + " ms: " +
        (complete ? plural(miss.size(), "rank", "ranks") : "at least " + plural(miss.size(), "rank", "ranks")) +
        " of " + std::to_string(ranks.count()) + " " + what + ": " + rank_list(miss);
    if (!complete) {
      msg += " (the rest were not checked)";
    }
    int32_t blamed = blame && miss.size() == 1 && complete ? miss[0] : -1;
    throw RdvError(GLOO_SHIM_TIMEOUT, blamed, msg);
  }

  const std::vector<std::string>& keys() const {
    return keys_;
  }

 private:
  // A store server (Redis) request may not outlast the deadline (plus a second for the
  // request itself); with no deadline in sight, no bound.
  void bound_io() {
    if (store_->io_timeout) {
      store_->io_timeout(left().count() + 1000);
    }
  }

  gloo_shim_store* store_;
  std::string prefix_;
  int rank_;
  int size_;
  Millis timeout_;
  std::chrono::steady_clock::time_point end_;
  std::vector<std::string> keys_;
};

// Whether this rank is the connecting side of the pair whose own listening address is `self`
// and whose peer listens at `peer` (Gloo's rule in tcp::Pair::connect: the larger address
// connects).
bool is_client(const std::vector<char>& self, const std::vector<char>& peer) {
  gloo::transport::tcp::Address a(self);
  gloo::transport::tcp::Address b(peer);
  const auto& sa = a.getSockaddr();
  const auto& sb = b.getSockaddr();
  if (sa.ss_family != sb.ss_family) {
    throw std::invalid_argument("address family mismatch between peers");
  }
  int rv = 0;
  if (sa.ss_family == AF_INET) {
    auto* x = reinterpret_cast<const struct sockaddr_in*>(&sa);
    auto* y = reinterpret_cast<const struct sockaddr_in*>(&sb);
    rv = std::memcmp(&x->sin_addr, &y->sin_addr, sizeof(struct in_addr));
    if (rv == 0) {
      rv = x->sin_port - y->sin_port;
    }
  } else if (sa.ss_family == AF_INET6) {
    auto* x = reinterpret_cast<const struct sockaddr_in6*>(&sa);
    auto* y = reinterpret_cast<const struct sockaddr_in6*>(&sb);
    rv = std::memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(struct in6_addr));
    if (rv == 0) {
      rv = x->sin6_port - y->sin6_port;
    }
  } else {
    throw std::invalid_argument("unknown address family");
  }
  return rv > 0;
}

// The whole rendezvous (phases A-E above); returns the connected context. A group of a
// connected communicator (`group`) skips phase A: its members and their number come from a
// communicator that is already connected, so there is no world size to doubt, and every member
// is known to exist (a missing one is blamed by name).
// A failed rendezvous's connections, closed at once under a Spin (each pair leaves the loop as
// it is destroyed: a tick each otherwise, see Waker), after the failure was announced.
void drop_pairs(
    gloo_shim_device* device, std::shared_ptr<MeshContext>& ctx,
    std::shared_ptr<gloo::transport::Context>& tc) {
  Spin spin(device->waker.get());
  ctx.reset();
  tc.reset();
}

std::shared_ptr<gloo::rendezvous::Context> connect_mesh(
    gloo_shim_store* store, const std::string& prefix, gloo_shim_device* device, int rank,
    int size, Millis timeout, bool group, std::vector<std::string>* keys_set) {
  Rendezvous rdv(store, prefix, rank, size, timeout);
  std::vector<int> others;
  auto record_keys = [&] { *keys_set = rdv.keys(); };

  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) {
    std::snprintf(host, sizeof(host), "unknown");
  }
  const std::string hostname(host);
  // A. arrival
  if (!group) {
    rdv.set(rdv.key("a", rank), hostname);
    record_keys();
    RankSet everyone;
    everyone.lo = 0;
    everyone.hi = size;
    everyone.skip = rank;
    rdv.wait_all(everyone, "a", "never arrived", false);
  }
  for (int i = 0; i < size; i++) {
    if (i != rank) {
      others.push_back(i);
    }
  }

  auto ctx = std::make_shared<MeshContext>(rank, size);
  ctx->setTimeout(timeout);
  // Declared outside the try block: a failing rank announces its failure (in the handlers
  // below) before its connections close, so a peer that sees them close finds the cause.
  std::shared_ptr<gloo::transport::Context> tc;
  try {
    // B. pairs, and this rank's key: its host name (4-byte length, then the name), then every
    // pair's address (Gloo's layout)
    tc = device->device->createContext(rank, size);
    tc->setTimeout(timeout);
    std::vector<std::vector<char>> mine(static_cast<size_t>(size));
    std::vector<char> all;
    const uint32_t host_len = static_cast<uint32_t>(hostname.size());
    all.resize(sizeof(host_len));
    std::memcpy(all.data(), &host_len, sizeof(host_len));
    all.insert(all.end(), hostname.begin(), hostname.end());
    for (int i : others) {
      auto& pair = tc->createPair(i);
      mine[i] = pair->address().bytes();
      all.insert(all.end(), mine[i].begin(), mine[i].end());
    }
    rdv.set(rdv.key("", rank), all);
    record_keys();

    // C. every peer's key; connect where this rank is the client
    RankSet peers;
    peers.list = &others;
    rdv.wait_all(
        peers, "", group ? "never arrived" : "arrived but never published their addresses", true);
    std::vector<std::vector<char>> theirs(static_cast<size_t>(size));
    std::vector<int> listening;
    // This rank's position among the members on its host (those before it with its host name).
    int local_rank = 0;
    for (int i : others) {
      auto v = rdv.get(rdv.key("", i));
      uint32_t len = 0;
      if (v.size() >= sizeof(len)) {
        std::memcpy(&len, v.data(), sizeof(len));
      }
      const size_t head = sizeof(len) + static_cast<size_t>(len);
      const size_t rest = v.size() >= head ? v.size() - head : 0;
      size_t per = rest / static_cast<size_t>(size - 1);
      if (v.size() < head || per == 0 || rest % static_cast<size_t>(size - 1) != 0) {
        throw RdvError(
            GLOO_SHIM_OTHER, i,
            "rank " + std::to_string(i) + " published addresses for a different world size (" +
                std::to_string(v.size()) + " bytes)");
      }
      if (i < rank && std::string(v.begin() + sizeof(len), v.begin() + head) == hostname) {
        local_rank++;
      }
      size_t at = head + static_cast<size_t>(rank > i ? rank - 1 : rank) * per;
      theirs[i].assign(v.begin() + at, v.begin() + at + per);
    }
    for (int i : others) {
      tc->getPair(i)->setLocalRank(local_rank);
    }
    // Connects the pair with rank i; `failure` begins the message when that fails.
    auto connect_pair = [&](int i, const std::string& failure) {
      try {
        tc->getPair(i)->connect(theirs[i]);
      } catch (const std::exception& e) {
        // A peer that failed first (and announced it) closes its sockets: relay its cause.
        rdv.check_failed();
        throw RdvError(GLOO_SHIM_IO, i, failure + e.what());
      }
    };
    {
      // A client's connect drops its listening socket: a loop tick (see Waker).
      Spin spin(device->waker.get());
      for (int i : others) {
        if (!is_client(mine[i], theirs[i])) {
          listening.push_back(i);
          continue;
        }
        connect_pair(
            i, "cannot connect to rank " + std::to_string(i) +
                " (it published its address, then died or closed it): ");
      }
    }

    // D. the pairs on which the peers connect to this rank
    rdv.set(rdv.key("c", rank), std::string("1"));
    record_keys();
    RankSet connecting;
    connecting.list = &listening;
    rdv.wait_all(
        connecting, "c", "never connected to this rank (died or stopped during the rendezvous)",
        true);
    {
      Spin spin(device->waker.get());
      for (int i : listening) {
        connect_pair(i, "the connection from rank " + std::to_string(i) + " failed: ");
      }
    }
    ctx->adopt(device->device, std::move(tc));

    // E. every member has completed its connections
    try {
      Yielding whole(device->waker.get());
      gloo::BarrierOptions opts(ctx);
      opts.setTag(kConnectBarrierTag);
      opts.setTimeout(std::max(rdv.left(), Millis(1)));
      gloo::barrier(opts);
    } catch (const RdvError&) {
      throw;
    } catch (const std::exception& e) {
      std::string msg = e.what();
      int32_t code = classify(msg, GLOO_SHIM_IO);
      if (code == GLOO_SHIM_TIMEOUT) {
        // Who never completed its connections?
        bool complete = true;
        auto miss = rdv.missing(peers, 0, "c", &complete);
        if (!miss.empty()) {
          throw RdvError(
              GLOO_SHIM_TIMEOUT, miss.size() == 1 ? miss[0] : -1,
              "rendezvous timed out after " + std::to_string(timeout.count()) + " ms: " +
                  rank_list(miss) +
                  (miss.size() == 1 ? " never completed its connections"
                                    : " never completed their connections") +
                  " (died or stopped during the rendezvous)");
        }
      }
      rdv.check_failed();
      gloo_shim_status st{};
      st.code = code;
      st.peer = -1;
      set_message(&st, "closing barrier of the rendezvous: " + msg);
      probe_peers(ctx.get(), &st);
      throw RdvError(code, st.peer, st.message);
    }
  } catch (const RdvError& e) {
    if (!e.relayed) {
      rdv.announce(e.peer, e.code, e.what());
    }
    record_keys();
    drop_pairs(device, ctx, tc);
    throw;
  } catch (const std::exception& e) {
    rdv.announce(-1, classify(e.what(), GLOO_SHIM_OTHER), e.what());
    record_keys();
    drop_pairs(device, ctx, tc);
    throw;
  }
  record_keys();
  return ctx;
}

// One wait of `b`, registered in `w` for the duration so that an abort can wake it. Gloo's
// waits return false only when abortWait* was called: here only by gloo_shim_context_abort_waits,
// whose flag the registration checks first (an abort between the check and the wait is seen by
// the wait, which reads the buffer's own abort flag under the buffer's lock).
void wait_one(
    P2pWaits& w, gloo::transport::UnboundBuffer& b, bool recv,
    std::chrono::steady_clock::time_point dl) {
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.aborted) {
      throw P2pAborted();
    }
    w.waiting.emplace_back(&b, recv);
  }
  auto leave = [&] {
    std::lock_guard<std::mutex> lock(w.mu);
    for (size_t i = 0; i < w.waiting.size(); i++) {
      if (w.waiting[i].first == &b && w.waiting[i].second == recv) {
        w.waiting.erase(w.waiting.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  };
  bool done = false;
  try {
    done = recv ? b.waitRecv(remaining(dl)) : b.waitSend(remaining(dl));
  } catch (...) {
    leave();
    throw;
  }
  leave();
  if (!done) {
    throw P2pAborted();
  }
}

// One posted point-to-point operation under the length protocol. `arrive` (receives only)
// waits for the header and acts on it; `complete` waits for everything still in flight.
// Destroying it cancels what is still pending and waits until Gloo no longer touches the
// memory (the unbound buffers go before the staging memory they point into).
class P2pTransfer {
 public:
  // The caller posts it inside a Yielding window of `waker` (may be null); `arrive` opens its
  // own around the payload's posts.
  P2pTransfer(
      gloo::Context& ctx, std::atomic<uint64_t>& seq, std::shared_ptr<P2pWaits> waits,
      std::shared_ptr<Waker> waker, std::shared_ptr<StagingPool> pool, gloo_shim_p2p_op& op,
      uint8_t prefix = kP2pSlotPrefix)
      : ctx_(ctx),
        waits_(std::move(waits)),
        waker_(std::move(waker)),
        pool_(std::move(pool)),
        op_(op),
        inline_max_(prefix == kCheckSlotPrefix ? kCheckInlineMax : kInlineMax) {
    check_op(ctx, op);
    op_.mismatch = 0;
    op_.other_dtype = -1;
    op_.other_count = 0;
    op_.other_head = 0;
    const size_t frame = op_.head_bytes;
    if (op_.is_recv) {
      // Room for the longest first message any sender makes, whatever this receive's frame.
      const size_t room = kHeader + kFrameMax + inline_max_;
      staging_.reset(pool_, room);
      head_ = ctx_.createUnboundBuffer(staging_.get(), room);
      head_->recv(op_.peer, header_slot(prefix, op_.tag), 0, room);
      return;
    }
    P2pHeader h{kP2pMagic, op_.dtype, op_.count, op_.bytes, 0, 0, frame};
    // The protocol's header and the caller's, then (inline) the payload: one message.
    auto stage = [&](size_t payload) {
      staging_.reset(pool_, kHeader + frame + payload);
      std::memcpy(staging_.get(), &h, kHeader);
      if (frame > 0) {
        std::memcpy(staging_.get() + kHeader, op_.head, frame);
      }
      return kHeader + frame + payload;
    };
    if (op_.bytes <= inline_max_) {
      const size_t len = stage(op_.bytes);
      if (op_.bytes > 0) {
        std::memcpy(staging_.get() + kHeader + frame, op_.ptr, op_.bytes);
        g_p2p_copied.fetch_add(op_.bytes, std::memory_order_relaxed);
      }
      head_ = ctx_.createUnboundBuffer(staging_.get(), len);
      head_->send(op_.peer, header_slot(prefix, op_.tag), 0, len);
      return;
    }
    h.chunk = kChunk;
    h.seq = seq.fetch_add(1, std::memory_order_relaxed);
    // The answer's receive goes first, so its notification reaches the receiver before the
    // header does and the answer never waits.
    reply_ = ctx_.createUnboundBuffer(&reply_msg_, sizeof(reply_msg_));
    reply_->recv(op_.peer, reply_slot(h.seq), 0, sizeof(reply_msg_));
    const size_t len = stage(0);
    head_ = ctx_.createUnboundBuffer(staging_.get(), len);
    head_->send(op_.peer, header_slot(prefix, op_.tag), 0, len);
    body_ = ctx_.createUnboundBuffer(op_.ptr, op_.bytes);
    for (size_t off = 0; off < op_.bytes; off += kChunk) {
      body_->send(op_.peer, payload_slot(h.seq), off, std::min(kChunk, op_.bytes - off));
      body_ops_++;
    }
  }

  void arrive(std::chrono::steady_clock::time_point deadline) {
    if (!op_.is_recv || arrived_) {
      return;
    }
    wait_one(*waits_, *head_, true, deadline);
    arrived_ = true;
    P2pHeader h;
    std::memcpy(&h, staging_.get(), kHeader);
    size_t width = dtype_size(h.dtype);
    if (h.magic != kP2pMagic || width == 0 || h.count > h.bytes / width ||
        h.count * width != h.bytes) {
      protocol_error(op_, "malformed header");
    }
    if (h.frame > kFrameMax) {
      protocol_error(op_, "a framed message's header longer than the limit");
    }
    // Both sides must frame alike: a framed message for a plain receive (or the reverse), or
    // headers of two lengths, are a mismatch like another count.
    const bool same_frame = h.frame == op_.head_bytes;
    const bool match = same_frame && h.dtype == op_.dtype && h.count == op_.count;
    if (!match) {
      op_.mismatch = 1;
      op_.other_dtype = h.dtype;
      op_.other_count = h.count;
      op_.other_head = h.frame;
    } else if (h.frame > 0) {
      std::memcpy(op_.head, staging_.get() + kHeader, h.frame);
    }
    if (h.chunk == 0) {
      if (h.bytes > inline_max_) {
        protocol_error(op_, "an inline payload larger than the inline limit");
      }
      const char* payload = staging_.get() + kHeader + h.frame;
      if (match && h.bytes > 0) {
        std::memcpy(op_.ptr, payload, h.bytes);
        g_p2p_copied.fetch_add(h.bytes, std::memory_order_relaxed);
      } else if (!match && same_frame && op_.keep_prefix != 0 && h.dtype == op_.dtype) {
        const size_t prefix = std::min<size_t>(static_cast<size_t>(h.bytes), op_.bytes);
        if (prefix > 0) {
          std::memcpy(op_.ptr, payload, prefix);
          g_p2p_copied.fetch_add(prefix, std::memory_order_relaxed);
        }
      }
      return;
    }
    if (h.chunk > kMaxChunk || h.bytes <= inline_max_) {
      protocol_error(op_, "a chunked payload of an impossible size");
    }
    const uint64_t slot = payload_slot(h.seq);
    reply_msg_ = P2pReply{
        kP2pMagic, match ? 0 : 1, op_.dtype, static_cast<uint32_t>(op_.head_bytes), op_.count};
    if (match) {
      Yielding posting(waker_.get());
      // Straight into the caller's memory: no copy. The payload's receives go before the
      // answer, so the payload starts at once and the answer travels beside it.
      body_ = ctx_.createUnboundBuffer(op_.ptr, op_.bytes);
      for (size_t off = 0; off < op_.bytes; off += h.chunk) {
        body_->recv(op_.peer, slot, off, std::min<uint64_t>(h.chunk, op_.bytes - off));
        body_ops_++;
      }
      send_reply(h.seq);
      return;
    }
    {
      Yielding posting(waker_.get());
      send_reply(h.seq);
    }
    // Drain the payload through one chunk of scratch memory, so that the sender completes and
    // the pair's next message is not stuck behind this one. The caller's memory stays as it
    // was.
    const size_t scratch_bytes = static_cast<size_t>(std::min<uint64_t>(h.chunk, h.bytes));
    std::unique_ptr<char[]> scratch(new char[scratch_bytes]);
    auto drain = ctx_.createUnboundBuffer(scratch.get(), scratch_bytes);
    for (uint64_t off = 0; off < h.bytes; off += h.chunk) {
      {
        Yielding posting(waker_.get());
        drain->recv(
            op_.peer, slot, 0, static_cast<size_t>(std::min<uint64_t>(h.chunk, h.bytes - off)));
      }
      wait_one(*waits_, *drain, true, deadline);
    }
    g_p2p_copied.fetch_add(h.bytes, std::memory_order_relaxed);
  }

  void complete(std::chrono::steady_clock::time_point deadline) {
    if (op_.is_recv) {
      arrive(deadline);
    } else if (!head_done_) {
      wait_one(*waits_, *head_, false, deadline);
      head_done_ = true;
    }
    for (; body_ops_ > 0; body_ops_--) {
      if (op_.is_recv) {
        wait_one(*waits_, *body_, true, deadline);
      } else {
        wait_one(*waits_, *body_, false, deadline);
      }
    }
    if (reply_ && !reply_done_) {
      if (op_.is_recv) {
        wait_one(*waits_, *reply_, false, deadline);
      } else {
        wait_one(*waits_, *reply_, true, deadline);
        const P2pReply& r = reply_msg_;
        if (r.magic != kP2pMagic || dtype_size(r.dtype) == 0) {
          protocol_error(op_, "a malformed answer to a large message");
        }
        if (r.mismatch != 0) {
          op_.mismatch = 1;
          op_.other_dtype = r.dtype;
          op_.other_count = r.count;
          op_.other_head = r.head;
        }
      }
      reply_done_ = true;
    }
  }

 private:
  void send_reply(uint64_t seq) {
    reply_ = ctx_.createUnboundBuffer(&reply_msg_, sizeof(reply_msg_));
    reply_->send(op_.peer, reply_slot(seq), 0, sizeof(reply_msg_));
  }

  gloo::Context& ctx_;
  std::shared_ptr<P2pWaits> waits_;
  std::shared_ptr<Waker> waker_;
  std::shared_ptr<StagingPool> pool_;
  gloo_shim_p2p_op& op_;
  // Largest payload that travels with its header (kCheckInlineMax on the check's slots).
  const size_t inline_max_;
  // Declared before the unbound buffers that point into it, so it goes back to the pool (or is
  // freed) after them.
  PooledBlock staging_;
  P2pReply reply_msg_{};
  std::unique_ptr<gloo::transport::UnboundBuffer> head_;
  std::unique_ptr<gloo::transport::UnboundBuffer> body_;
  // The answer to a chunked message: received by the sender, sent by the receiver.
  std::unique_ptr<gloo::transport::UnboundBuffer> reply_;
  size_t body_ops_ = 0;
  bool arrived_ = false;
  bool head_done_ = false;
  bool reply_done_ = false;
};


}  // namespace

// A posted operation: its own copy of the op (the transfer writes the outputs into it), the
// context it runs on, and the transfer (destroyed first: declared last).
struct gloo_shim_pending {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  gloo_shim_p2p_op op;
  std::unique_ptr<P2pTransfer> transfer;
};

extern "C" {

// ---- stores ------------------------------------------------------------------------------------

int32_t gloo_shim_store_hash_new(gloo_shim_store** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    auto store = std::make_shared<ErasableHashStore>();
    ErasableHashStore* raw = store.get();
    *out = new gloo_shim_store{
        store, [raw](const std::string& k) { raw->erase(k); }, [raw] { return raw->count(); },
        [raw](const std::vector<std::string>& k, std::vector<char>& o) { raw->exists(k, o); },
        nullptr};
  });
}

int32_t gloo_shim_store_file_new(const char* path, gloo_shim_store** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    auto store = std::make_shared<ErasableFileStore>(path);
    ErasableFileStore* raw = store.get();
    *out = new gloo_shim_store{
        store, [raw](const std::string& k) { raw->erase(k); }, nullptr,
        [raw](const std::vector<std::string>& k, std::vector<char>& o) { raw->exists(k, o); },
        nullptr};
  });
}

int32_t gloo_shim_store_redis_new(
    const char* host, int32_t port, gloo_shim_store** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    auto store = std::make_shared<ErasableRedisStore>(host, port);
    ErasableRedisStore* raw = store.get();
    *out = new gloo_shim_store{
        store, [raw](const std::string& k) { raw->erase(k); }, nullptr,
        [raw](const std::vector<std::string>& k, std::vector<char>& o) { raw->exists(k, o); },
        [raw](int64_t ms) { raw->io_timeout(ms); }};
  });
}

gloo_shim_store* gloo_shim_store_clone(const gloo_shim_store* store) {
  try {
    return new gloo_shim_store{
        store->store, store->erase, store->count, store->exists, store->io_timeout};
  } catch (...) {
    return nullptr;
  }
}

void gloo_shim_store_free(gloo_shim_store* store) {
  try {
    delete store;
  } catch (...) {
  }
}

int32_t gloo_shim_store_set(
    gloo_shim_store* store, const char* prefix, const char* key, const void* data, size_t len,
    gloo_shim_status* st) {
  return guarded(nullptr, st, [&] {
    gloo::rendezvous::PrefixStore prefixed(prefix, *store->store);
    const char* p = static_cast<const char*>(data);
    prefixed.set(key, std::vector<char>(p, p + len));
  });
}

int64_t gloo_shim_store_count(const gloo_shim_store* store) {
  try {
    return store->count ? static_cast<int64_t>(store->count()) : -1;
  } catch (...) {
    return -1;
  }
}

int32_t gloo_shim_store_get(
    gloo_shim_store* store, const char* prefix, const char* key, int64_t timeout_ms, void* buf,
    size_t cap, size_t* len, gloo_shim_status* st) {
  *len = 0;
  int32_t rc = guarded(nullptr, st, [&] {
    BoundedStore bounded(store->store, to_millis(timeout_ms));
    gloo::rendezvous::PrefixStore prefixed(prefix, bounded);
    auto value = prefixed.get(key);
    *len = value.size();
    if (value.size() <= cap) {
      if (!value.empty()) {
        std::memcpy(buf, value.data(), value.size());
      }
    }
  });
  if (rc == GLOO_SHIM_OK && *len > cap) {
    return fail(st, GLOO_SHIM_TOO_SMALL, "value larger than the buffer");
  }
  return rc;
}

int32_t gloo_shim_store_try_get(
    gloo_shim_store* store, const char* prefix, const char* key, void* buf, size_t cap,
    size_t* len, int32_t* found, gloo_shim_status* st) {
  *len = 0;
  *found = 0;
  int32_t rc = guarded(nullptr, st, [&] {
    std::string full = std::string(prefix) + "/" + key;
    std::vector<char> present;
    store->exists({full}, present);
    if (!present[0]) {
      return;
    }
    // The key exists; a bounded wait covers a removal racing with this read.
    BoundedStore bounded(store->store, Millis(1000));
    auto value = bounded.get(full);
    *found = 1;
    *len = value.size();
    if (value.size() <= cap && !value.empty()) {
      std::memcpy(buf, value.data(), value.size());
    }
  });
  if (rc == GLOO_SHIM_OK && *len > cap) {
    return fail(st, GLOO_SHIM_TOO_SMALL, "value larger than the buffer");
  }
  return rc;
}

int32_t gloo_shim_store_set_io_timeout(
    gloo_shim_store* store, int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(nullptr, st, [&] {
    if (store->io_timeout) {
      store->io_timeout(timeout_ms);
    }
  });
}

// ---- devices and contexts ------------------------------------------------------------------------

int32_t gloo_shim_device_tcp_new(
    const char* hostname, gloo_shim_device** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto waker = Waker::make(device);
    *out = new gloo_shim_device{std::move(device), std::move(waker)};
  });
}

void gloo_shim_device_free(gloo_shim_device* device) {
  try {
    delete device;
  } catch (...) {
  }
}

int32_t gloo_shim_context_connect(
    gloo_shim_store* store, const char* prefix, gloo_shim_device* device, int32_t rank,
    int32_t size, int64_t timeout_ms, int32_t group, gloo_shim_context** out,
    gloo_shim_status* st) {
  *out = nullptr;
  // A failure of the rendezvous itself keeps its code and the rank it blames.
  bool rdv_failed = false;
  int32_t rdv_code = GLOO_SHIM_OTHER;
  int32_t rdv_peer = -1;
  std::string rdv_message;
  int32_t rc = guarded(nullptr, st, [&] {
    if (size < 1 || rank < 0 || rank >= size) {
      throw std::invalid_argument(
          "rank " + std::to_string(rank) + " of size " + std::to_string(size) +
          ": need 0 <= rank < size");
    }
    std::vector<std::string> keys_set;
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    try {
      ctx = connect_mesh(
          store, prefix, device, rank, size, to_millis(timeout_ms), group != 0, &keys_set);
    } catch (const RdvError& e) {
      rdv_failed = true;
      rdv_code = e.code;
      rdv_peer = e.peer;
      rdv_message = e.what();
      return;
    }
    // The closing barrier returned, so every member has finished its connections and read
    // every key it needs: nobody reads this group's keys again. Each rank removes the keys it
    // set itself (best effort: a key left behind costs space, not correctness).
    if (group != 0 && store->erase) {
      for (const auto& key : keys_set) {
        try {
          store->erase(key);
        } catch (...) {
        }
      }
    }
    *out = new gloo_shim_context{std::move(ctx), {}};
    (*out)->waker = device->waker;
    // A round posts a send and a receive per peer: keep that many blocks (at least 2, at most
    // 32, about 2 MiB), enough for every transfer of a round up to 17 ranks.
    const size_t kept = std::clamp<size_t>(2 * (static_cast<size_t>(size) - 1), 2, 32);
    (*out)->staging =
        std::make_shared<StagingPool>(kHeader + kFrameMax + kCheckInlineMax, kept);
  });
  if (rdv_failed) {
    fail(st, rdv_code, rdv_message);
    st->peer = rdv_peer;
    return rdv_code;
  }
  return rc;
}

void gloo_shim_context_close(gloo_shim_context* ctx) {
  if (ctx == nullptr || !ctx->ctx) {
    return;
  }
  // A pair leaves the loop as it closes (a tick each, see Waker).
  Spin spin(ctx->waker.get());
  for (int i = 0; i < ctx->ctx->size; i++) {
    if (i == ctx->ctx->rank) {
      continue;
    }
    try {
      auto& pair = ctx->ctx->getPair(i);
      if (pair) {
        pair->close();
      }
    } catch (...) {
    }
  }
}

}  // extern "C"

// gloo::transport::tcp::Pair::signalExceptionExternal(const std::string&), exported by libgloo
// but declared in a header (gloo/transport/tcp/pair.h) that Debian's libgloo-dev cannot compile
// (it includes gloo/common/memory.h, which the package does not ship). Declared here by its
// mangled name as a free function with the same Itanium C++ ABI calling sequence: the hidden
// return slot, then `this`, then the message. Invariants: every pair of a context this shim
// creates is a tcp::Pair (the shim only creates TCP devices), whose only base is
// gloo::transport::Pair, so the base pointer is the tcp::Pair's `this`.
std::exception_ptr gloo_tcp_pair_signal_exception_external(void* self, const std::string& msg)
    __asm__("_ZN4gloo9transport3tcp4Pair23signalExceptionExternalERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");

namespace {

// Fails one TCP pair as a lost connection would: every operation waiting on it (a collective's
// internal buffers included) wakes with an I/O error, and the pair closes.
void fail_tcp_pair(gloo::transport::Pair* pair, const std::string& msg) {
  gloo_tcp_pair_signal_exception_external(static_cast<void*>(pair), msg);
}

}  // namespace

extern "C" {

void gloo_shim_context_abort_waits(gloo_shim_context* ctx) {
  if (ctx == nullptr || !ctx->waits) {
    return;
  }
  try {
    std::lock_guard<std::mutex> lock(ctx->waits->mu);
    ctx->waits->aborted = true;
    for (auto& [buf, recv] : ctx->waits->waiting) {
      if (recv) {
        buf->abortWaitRecv();
      } else {
        buf->abortWaitSend();
      }
    }
  } catch (...) {
  }
  // Collectives wait inside Gloo's algorithms on buffers the shim never sees: failing every
  // TCP pair (tcp::Pair::signalExceptionExternal, the path of a lost connection) wakes each
  // of them with an I/O error and closes the pair.
  if (!ctx->ctx) {
    return;
  }
  for (int i = 0; i < ctx->ctx->size; i++) {
    if (i == ctx->ctx->rank) {
      continue;
    }
    try {
      auto& pair = ctx->ctx->getPair(i);
      if (pair) {
        fail_tcp_pair(pair.get(), "the communicator was aborted on this rank (abort() was called)");
      }
    } catch (...) {
    }
  }
}

void gloo_shim_context_free(gloo_shim_context* ctx) {
  if (ctx == nullptr) {
    return;
  }
  try {
    drop_hd(ctx);
  } catch (...) {
  }
  try {
    // Each pair leaves the loop as it is destroyed (a tick each, see Waker).
    Spin spin(ctx->waker.get());
    ctx->ctx.reset();
  } catch (...) {
  }
  try {
    delete ctx;
  } catch (...) {
  }
}

int32_t gloo_shim_context_rank(const gloo_shim_context* ctx) {
  return ctx->ctx->rank;
}

int32_t gloo_shim_context_size(const gloo_shim_context* ctx) {
  return ctx->ctx->size;
}

// ---- collectives -----------------------------------------------------------------------------------

}  // extern "C"

namespace {

// The Waker a collective of libgloo's of `bytes` bytes (its largest buffer) holds a Yielding
// window of for its whole run (null: none, the loop sleeps in epoll_wait between events):
// libgloo's algorithms post their sends and receives from this thread while the loop handles
// the same pairs. It polls below the smaller of the context's limit and `op_below`, the
// operation's own (SIZE_MAX: none).
Waker* polling(gloo_shim_context* c, size_t bytes, size_t op_below = SIZE_MAX) {
  const size_t below = std::min(op_below, c->busy_poll_below.load(std::memory_order_relaxed));
  const bool on = c->busy_poll.load(std::memory_order_relaxed) && bytes < below;
  return on ? c->waker.get() : nullptr;
}

}  // namespace

extern "C" {

void gloo_shim_context_set_busy_poll(gloo_shim_context* c, int32_t on) {
  c->busy_poll.store(on != 0, std::memory_order_relaxed);
}

int32_t gloo_shim_context_busy_poll(const gloo_shim_context* c) {
  return c->busy_poll.load(std::memory_order_relaxed) ? 1 : 0;
}

void gloo_shim_context_set_busy_poll_below(gloo_shim_context* c, size_t bytes) {
  c->busy_poll_below.store(bytes, std::memory_order_relaxed);
}

size_t gloo_shim_context_busy_poll_below(const gloo_shim_context* c) {
  return c->busy_poll_below.load(std::memory_order_relaxed);
}

int32_t gloo_shim_allreduce(
    gloo_shim_context* c, const void* send, void* recv, size_t count, int32_t dtype, int32_t op,
    gloo_shim_reduce_fn reduce, int32_t algorithm, size_t max_segment_bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    Yielding whole(polling(c, count * dtype_size(dtype)));
    if (!valid_dtype(dtype) || !valid_op(op) || reduce == nullptr) {
      throw std::invalid_argument("unknown dtype or reduction, or no reduction function");
    }
    if (algorithm != GLOO_SHIM_ALLREDUCE_RING && algorithm != GLOO_SHIM_ALLREDUCE_BCUBE) {
      throw std::invalid_argument("unknown allreduce algorithm " + std::to_string(algorithm));
    }
    if (count == 0) {
      return;
    }
    with_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      run_allreduce<T>(
          c->ctx, send, recv, count, op, reduce, algorithm, max_segment_bytes, tag,
          to_millis(timeout_ms));
    });
  });
}

int32_t gloo_shim_broadcast(
    gloo_shim_context* c, void* buf, size_t bytes, int32_t root, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    // A large broadcast's ranks each copy one way while their loop threads would poll.
    Yielding whole(polling(c, bytes, GLOO_SHIM_BROADCAST_BUSY_POLL_BELOW));
    if (bytes == 0) {
      return;
    }
    gloo::BroadcastOptions opts(c->ctx);
    opts.setOutput(static_cast<uint8_t*>(buf), bytes);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::broadcast(opts);
  });
}

int32_t gloo_shim_allgather(
    gloo_shim_context* c, const void* send, void* recv, size_t bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    Yielding whole(polling(c, bytes * static_cast<size_t>(c->ctx->size)));
    if (bytes == 0) {
      return;
    }
    gloo::AllgatherOptions opts(c->ctx);
    if (send != nullptr) {
      // Without an input Gloo gathers in place: this rank's block is already in the output.
      opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
    }
    opts.setOutput(static_cast<uint8_t*>(recv), bytes * static_cast<size_t>(c->ctx->size));
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::allgather(opts);
  });
}

int32_t gloo_shim_reduce_scatter(
    gloo_shim_context* c, const void* send, void* recv, size_t recv_count, int32_t dtype,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, int32_t allreduce_algorithm,
    size_t max_segment_bytes, uint32_t tag, int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    Yielding whole(
        polling(c, recv_count * static_cast<size_t>(c->ctx->size) * dtype_size(dtype)));
    if (!valid_dtype(dtype) || !valid_op(op) || reduce == nullptr) {
      throw std::invalid_argument("unknown dtype or reduction, or no reduction function");
    }
    if (allreduce_algorithm != GLOO_SHIM_ALLREDUCE_RING &&
        allreduce_algorithm != GLOO_SHIM_ALLREDUCE_BCUBE) {
      throw std::invalid_argument(
          "unknown allreduce algorithm " + std::to_string(allreduce_algorithm));
    }
    if (recv_count == 0) {
      return;
    }
    with_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      const size_t total_bytes = recv_count * static_cast<size_t>(c->ctx->size) * sizeof(T);
      // The legacy algorithm counts elements and bytes in `int`.
      bool fits = total_bytes <= static_cast<size_t>(std::numeric_limits<int>::max());
      if (algorithm == GLOO_SHIM_RS_HALVING_DOUBLING && fits) {
        run_reduce_scatter_hd<T>(c, send, recv, recv_count, dtype, op, reduce);
      } else if (algorithm == GLOO_SHIM_RS_RING) {
        run_reduce_scatter_ring<T>(
            c, send, recv, recv_count, op, reduce, tag, to_millis(timeout_ms));
      } else {
        run_reduce_scatter_ar<T>(
            c, send, recv, recv_count, op, reduce, allreduce_algorithm, max_segment_bytes, tag,
            to_millis(timeout_ms));
      }
    });
  });
}

int32_t gloo_shim_alltoall(
    gloo_shim_context* c, const void* send, void* recv, size_t bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    Yielding whole(polling(c, bytes));
    if (bytes == 0) {
      return;
    }
    gloo::AlltoallOptions opts(c->ctx);
    opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
    opts.setOutput(static_cast<uint8_t*>(recv), bytes);
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::alltoall(opts);
  });
}

int32_t gloo_shim_barrier(
    gloo_shim_context* c, uint32_t tag, int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    Yielding whole(polling(c, 0));
    gloo::BarrierOptions opts(c->ctx);
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::barrier(opts);
  });
}

// ---- point to point --------------------------------------------------------------------------------

}  // extern "C"

namespace {

// gloo_shim_p2p and gloo_shim_exchange: the headers travel on slot prefix `prefix`.
int32_t run_p2p(
    gloo_shim_context* c, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st, uint8_t prefix) {
  return guarded(c->ctx.get(), st, [&] {
    auto deadline = std::chrono::steady_clock::now() + to_millis(timeout_ms);
    // Unwinding out of this block destroys every transfer, which cancels what is pending and
    // waits until the transport no longer touches its memory.
    // Every operation is checked before any is posted: a bad one must not leave the others
    // cancelled in flight.
    for (size_t i = 0; i < n; i++) {
      check_op(*c->ctx, ops[i]);
    }
    std::vector<std::unique_ptr<P2pTransfer>> transfers;
    transfers.reserve(n);
    {
      Yielding posting(c->waker.get());
      for (size_t i = 0; i < n; i++) {
        transfers.emplace_back(
            new P2pTransfer(*c->ctx, c->p2p_seq, c->waits, c->waker, c->staging, ops[i], prefix));
      }
    }
    // Every header first (each receive posts its payload as soon as its header is read), then
    // everything else. The peers posted all of their sends when their own calls began, so no
    // wait here depends on a later step of this call.
    for (auto& t : transfers) {
      t->arrive(deadline);
    }
    for (auto& t : transfers) {
      t->complete(deadline);
    }
  });
}

}  // namespace

extern "C" {

int32_t gloo_shim_p2p(
    gloo_shim_context* c, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st) {
  return run_p2p(c, ops, n, timeout_ms, st, kP2pSlotPrefix);
}

int32_t gloo_shim_exchange(
    gloo_shim_context* c, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st) {
  return run_p2p(c, ops, n, timeout_ms, st, kCollSlotPrefix);
}

int32_t gloo_shim_check_exchange(
    gloo_shim_context* c, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st) {
  return run_p2p(c, ops, n, timeout_ms, st, kCheckSlotPrefix);
}

uint64_t gloo_shim_p2p_copied_bytes(void) {
  return g_p2p_copied.load(std::memory_order_relaxed);
}

int32_t gloo_shim_post(
    gloo_shim_context* c, const gloo_shim_p2p_op* op, gloo_shim_pending** out,
    gloo_shim_status* st) {
  *out = nullptr;
  return guarded(c->ctx.get(), st, [&] {
    std::unique_ptr<gloo_shim_pending> p(new gloo_shim_pending{c->ctx, *op, nullptr});
    Yielding posting(c->waker.get());
    p->transfer.reset(
        new P2pTransfer(*c->ctx, c->p2p_seq, c->waits, c->waker, c->staging, p->op));
    *out = p.release();
  });
}

int32_t gloo_shim_pending_wait(
    gloo_shim_pending* pending, int64_t timeout_ms, gloo_shim_p2p_op* result,
    gloo_shim_status* st) {
  return guarded(pending->ctx.get(), st, [&] {
    auto deadline = std::chrono::steady_clock::now() + to_millis(timeout_ms);
    pending->transfer->complete(deadline);
    *result = pending->op;
  });
}

void gloo_shim_pending_free(gloo_shim_pending* pending) {
  try {
    delete pending;
  } catch (...) {
  }
}

}  // extern "C"

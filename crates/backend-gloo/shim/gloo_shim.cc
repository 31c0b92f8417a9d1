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
#include <vector>

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
};

// Passes everything to `base` and remembers the keys this rank set.
class RecordingStore : public gloo::rendezvous::Store {
 public:
  explicit RecordingStore(gloo::rendezvous::Store& base) : base_(base) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    base_.set(key, data);
    keys_.push_back(key);
  }
  std::vector<char> get(const std::string& key) override {
    return base_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override {
    base_.wait(keys);
  }
  void wait(const std::vector<std::string>& keys, const Millis& timeout) override {
    base_.wait(keys, timeout);
  }
  const std::vector<std::string>& keys() const {
    return keys_;
  }

 private:
  gloo::rendezvous::Store& base_;
  std::vector<std::string> keys_;
};

}  // namespace

struct gloo_shim_store {
  std::shared_ptr<gloo::rendezvous::Store> store;
  // Removes one key (full name) from `store`; captures a pointer kept alive by `store`.
  std::function<void(const std::string&)> erase;
  // Number of keys, where the store can tell (the in-memory store); else null.
  std::function<size_t()> count;
};

struct gloo_shim_device {
  std::shared_ptr<gloo::transport::Device> device;
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
  return d >= GLOO_SHIM_F32 && d <= GLOO_SHIM_BF16;
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
    default:
      throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
  }
}

template <typename T>
void run_allreduce(
    const std::shared_ptr<gloo::Context>& ctx, const void* send, void* recv, size_t count,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, uint32_t tag, Millis timeout) {
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
    gloo_shim_reduce_fn reduce, uint32_t tag, Millis timeout) {
  const size_t size = static_cast<size_t>(c->ctx->size);
  std::vector<T> scratch(recv_count * size);
  run_allreduce<T>(
      c->ctx, send, scratch.data(), recv_count * size, op, reduce, GLOO_SHIM_ALLREDUCE_RING,
      tag, timeout);
  std::memcpy(
      recv, scratch.data() + static_cast<size_t>(c->ctx->rank) * recv_count,
      recv_count * sizeof(T));
}

// ---- point to point: the length protocol (described in gloo_shim.h) ---------------------------

// "GRDP": the first four bytes of every point-to-point header.
constexpr uint32_t kP2pMagic = 0x50445247u;
constexpr size_t kInlineMax = GLOO_SHIM_P2P_INLINE_MAX;
constexpr size_t kChunk = GLOO_SHIM_P2P_CHUNK;
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
};
static_assert(sizeof(P2pHeader) == 40, "the header is 40 bytes on every rank");
constexpr size_t kHeader = sizeof(P2pHeader);

// The receiver's answer to a chunked message: whether it matched, and what the receive posted.
struct P2pReply {
  uint32_t magic;
  int32_t mismatch;
  int32_t dtype;
  uint32_t reserved;
  uint64_t count;
};
static_assert(sizeof(P2pReply) == 24, "the answer is 24 bytes on every rank");

size_t dtype_size(int32_t d) {
  switch (d) {
    case GLOO_SHIM_F32:
    case GLOO_SHIM_I32:
      return 4;
    case GLOO_SHIM_F64:
    case GLOO_SHIM_I64:
      return 8;
    case GLOO_SHIM_U8:
      return 1;
    case GLOO_SHIM_F16:
    case GLOO_SHIM_BF16:
      return 2;
    default:
      return 0;
  }
}

uint64_t header_slot(uint32_t tag) {
  return gloo::Slot::build(kP2pSlotPrefix, tag);
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

// Gloo's waits return false only when another thread called abortWait*, which the shim never
// does; treat it as a failure rather than a completion.
void wait_recv(gloo::transport::UnboundBuffer& b, std::chrono::steady_clock::time_point dl) {
  if (!b.waitRecv(remaining(dl))) {
    throw std::runtime_error("a receive was interrupted");
  }
}

void wait_send(gloo::transport::UnboundBuffer& b, std::chrono::steady_clock::time_point dl) {
  if (!b.waitSend(remaining(dl))) {
    throw std::runtime_error("a send was interrupted");
  }
}

// One posted point-to-point operation under the length protocol. `arrive` (receives only)
// waits for the header and acts on it; `complete` waits for everything still in flight.
// Destroying it cancels what is still pending and waits until Gloo no longer touches the
// memory (the unbound buffers go before the staging memory they point into).
class P2pTransfer {
 public:
  P2pTransfer(gloo::Context& ctx, std::atomic<uint64_t>& seq, gloo_shim_p2p_op& op)
      : ctx_(ctx), op_(op) {
    check_op(ctx, op);
    op_.mismatch = 0;
    op_.other_dtype = -1;
    op_.other_count = 0;
    if (op_.is_recv) {
      staging_.reset(new char[kHeader + kInlineMax]);
      head_ = ctx_.createUnboundBuffer(staging_.get(), kHeader + kInlineMax);
      head_->recv(op_.peer, header_slot(op_.tag), 0, kHeader + kInlineMax);
      return;
    }
    P2pHeader h{kP2pMagic, op_.dtype, op_.count, op_.bytes, 0, 0};
    if (op_.bytes <= kInlineMax) {
      staging_.reset(new char[kHeader + op_.bytes]);
      std::memcpy(staging_.get(), &h, kHeader);
      if (op_.bytes > 0) {
        std::memcpy(staging_.get() + kHeader, op_.ptr, op_.bytes);
        g_p2p_copied.fetch_add(op_.bytes, std::memory_order_relaxed);
      }
      head_ = ctx_.createUnboundBuffer(staging_.get(), kHeader + op_.bytes);
      head_->send(op_.peer, header_slot(op_.tag), 0, kHeader + op_.bytes);
      return;
    }
    h.chunk = kChunk;
    h.seq = seq.fetch_add(1, std::memory_order_relaxed);
    // The answer's receive goes first, so its notification reaches the receiver before the
    // header does and the answer never waits.
    reply_ = ctx_.createUnboundBuffer(&reply_msg_, sizeof(reply_msg_));
    reply_->recv(op_.peer, reply_slot(h.seq), 0, sizeof(reply_msg_));
    staging_.reset(new char[kHeader]);
    std::memcpy(staging_.get(), &h, kHeader);
    head_ = ctx_.createUnboundBuffer(staging_.get(), kHeader);
    head_->send(op_.peer, header_slot(op_.tag), 0, kHeader);
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
    wait_recv(*head_, deadline);
    arrived_ = true;
    P2pHeader h;
    std::memcpy(&h, staging_.get(), kHeader);
    size_t width = dtype_size(h.dtype);
    if (h.magic != kP2pMagic || width == 0 || h.count > h.bytes / width ||
        h.count * width != h.bytes) {
      protocol_error(op_, "malformed header");
    }
    const bool match = h.dtype == op_.dtype && h.count == op_.count;
    if (!match) {
      op_.mismatch = 1;
      op_.other_dtype = h.dtype;
      op_.other_count = h.count;
    }
    if (h.chunk == 0) {
      if (h.bytes > kInlineMax) {
        protocol_error(op_, "an inline payload larger than the inline limit");
      }
      if (match && h.bytes > 0) {
        std::memcpy(op_.ptr, staging_.get() + kHeader, h.bytes);
        g_p2p_copied.fetch_add(h.bytes, std::memory_order_relaxed);
      }
      return;
    }
    if (h.chunk > kMaxChunk || h.bytes <= kInlineMax) {
      protocol_error(op_, "a chunked payload of an impossible size");
    }
    const uint64_t slot = payload_slot(h.seq);
    reply_msg_ = P2pReply{kP2pMagic, match ? 0 : 1, op_.dtype, 0, op_.count};
    if (match) {
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
    send_reply(h.seq);
    // Drain the payload through one chunk of scratch memory, so that the sender completes and
    // the pair's next message is not stuck behind this one. The caller's memory stays as it
    // was.
    const size_t scratch_bytes = static_cast<size_t>(std::min<uint64_t>(h.chunk, h.bytes));
    std::unique_ptr<char[]> scratch(new char[scratch_bytes]);
    auto drain = ctx_.createUnboundBuffer(scratch.get(), scratch_bytes);
    for (uint64_t off = 0; off < h.bytes; off += h.chunk) {
      drain->recv(op_.peer, slot, 0, static_cast<size_t>(std::min<uint64_t>(h.chunk, h.bytes - off)));
      wait_recv(*drain, deadline);
    }
    g_p2p_copied.fetch_add(h.bytes, std::memory_order_relaxed);
  }

  void complete(std::chrono::steady_clock::time_point deadline) {
    if (op_.is_recv) {
      arrive(deadline);
    } else if (!head_done_) {
      wait_send(*head_, deadline);
      head_done_ = true;
    }
    for (; body_ops_ > 0; body_ops_--) {
      if (op_.is_recv) {
        wait_recv(*body_, deadline);
      } else {
        wait_send(*body_, deadline);
      }
    }
    if (reply_ && !reply_done_) {
      if (op_.is_recv) {
        wait_send(*reply_, deadline);
      } else {
        wait_recv(*reply_, deadline);
        const P2pReply& r = reply_msg_;
        if (r.magic != kP2pMagic || dtype_size(r.dtype) == 0) {
          protocol_error(op_, "a malformed answer to a large message");
        }
        if (r.mismatch != 0) {
          op_.mismatch = 1;
          op_.other_dtype = r.dtype;
          op_.other_count = r.count;
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
  gloo_shim_p2p_op& op_;
  // Declared before the unbound buffers that point into them, so they are freed after them.
  std::unique_ptr<char[]> staging_;
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
        store, [raw](const std::string& k) { raw->erase(k); }, [raw] { return raw->count(); }};
  });
}

int32_t gloo_shim_store_file_new(const char* path, gloo_shim_store** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    auto store = std::make_shared<ErasableFileStore>(path);
    ErasableFileStore* raw = store.get();
    *out = new gloo_shim_store{store, [raw](const std::string& k) { raw->erase(k); }, nullptr};
  });
}

int32_t gloo_shim_store_redis_new(
    const char* host, int32_t port, gloo_shim_store** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    auto store = std::make_shared<ErasableRedisStore>(host, port);
    ErasableRedisStore* raw = store.get();
    *out = new gloo_shim_store{store, [raw](const std::string& k) { raw->erase(k); }, nullptr};
  });
}

gloo_shim_store* gloo_shim_store_clone(const gloo_shim_store* store) {
  try {
    return new gloo_shim_store{store->store, store->erase, store->count};
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

// ---- devices and contexts ------------------------------------------------------------------------

int32_t gloo_shim_device_tcp_new(
    const char* hostname, gloo_shim_device** out, gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    *out = new gloo_shim_device{gloo::transport::tcp::CreateDevice(attr)};
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
    int32_t size, int64_t timeout_ms, int32_t remove_keys, gloo_shim_context** out,
    gloo_shim_status* st) {
  *out = nullptr;
  return guarded(nullptr, st, [&] {
    if (size < 1 || rank < 0 || rank >= size) {
      throw std::invalid_argument(
          "rank " + std::to_string(rank) + " of size " + std::to_string(size) +
          ": need 0 <= rank < size");
    }
    Millis timeout = to_millis(timeout_ms);
    BoundedStore bounded(store->store, timeout);
    RecordingStore recorded(bounded);
    gloo::rendezvous::PrefixStore prefixed(prefix, recorded);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(prefixed, device->device);
    // connectFullMesh returns when this rank's own connections are up, not the peers': a peer
    // that is still connecting would see "connection closed" if this rank dropped the context
    // at once. A barrier makes the rendezvous complete on every member before any returns.
    // Its tag is reserved: user collectives take tags from a counter starting at 0.
    gloo::BarrierOptions opts(ctx);
    opts.setTag(kConnectBarrierTag);
    opts.setTimeout(timeout);
    gloo::barrier(opts);
    // The barrier returned, so every member has entered it, that is, has finished
    // connectFullMesh and read every key it needs: nobody reads this group's keys again. Each
    // rank removes the keys it set itself (best effort: a key left behind costs space, not
    // correctness, and the context is good).
    if (remove_keys != 0 && store->erase) {
      for (const auto& key : recorded.keys()) {
        try {
          store->erase(key);
        } catch (...) {
        }
      }
    }
    *out = new gloo_shim_context{std::move(ctx), {}};
  });
}

void gloo_shim_context_free(gloo_shim_context* ctx) {
  try {
    drop_hd(ctx);
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

int32_t gloo_shim_allreduce(
    gloo_shim_context* c, const void* send, void* recv, size_t count, int32_t dtype, int32_t op,
    gloo_shim_reduce_fn reduce, int32_t algorithm, uint32_t tag, int64_t timeout_ms,
    gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    if (!valid_dtype(dtype) || !valid_op(op) || reduce == nullptr) {
      throw std::invalid_argument("unknown dtype or reduction, or no reduction function");
    }
    if (count == 0) {
      return;
    }
    with_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      run_allreduce<T>(
          c->ctx, send, recv, count, op, reduce, algorithm, tag, to_millis(timeout_ms));
    });
  });
}

int32_t gloo_shim_broadcast(
    gloo_shim_context* c, void* buf, size_t bytes, int32_t root, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
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
    if (bytes == 0) {
      return;
    }
    gloo::AllgatherOptions opts(c->ctx);
    opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
    opts.setOutput(static_cast<uint8_t*>(recv), bytes * static_cast<size_t>(c->ctx->size));
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::allgather(opts);
  });
}

int32_t gloo_shim_reduce_scatter(
    gloo_shim_context* c, const void* send, void* recv, size_t recv_count, int32_t dtype,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, uint32_t tag, int64_t timeout_ms,
    gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
    if (!valid_dtype(dtype) || !valid_op(op) || reduce == nullptr) {
      throw std::invalid_argument("unknown dtype or reduction, or no reduction function");
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
      } else {
        run_reduce_scatter_ar<T>(
            c, send, recv, recv_count, op, reduce, tag, to_millis(timeout_ms));
      }
    });
  });
}

int32_t gloo_shim_alltoall(
    gloo_shim_context* c, const void* send, void* recv, size_t bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st) {
  return guarded(c->ctx.get(), st, [&] {
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
    gloo::BarrierOptions opts(c->ctx);
    opts.setTag(tag);
    opts.setTimeout(to_millis(timeout_ms));
    gloo::barrier(opts);
  });
}

// ---- point to point --------------------------------------------------------------------------------

int32_t gloo_shim_p2p(
    gloo_shim_context* c, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st) {
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
    for (size_t i = 0; i < n; i++) {
      transfers.emplace_back(new P2pTransfer(*c->ctx, c->p2p_seq, ops[i]));
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

uint64_t gloo_shim_p2p_copied_bytes(void) {
  return g_p2p_copied.load(std::memory_order_relaxed);
}

int32_t gloo_shim_post(
    gloo_shim_context* c, const gloo_shim_p2p_op* op, gloo_shim_pending** out,
    gloo_shim_status* st) {
  *out = nullptr;
  return guarded(c->ctx.get(), st, [&] {
    std::unique_ptr<gloo_shim_pending> p(new gloo_shim_pending{c->ctx, *op, nullptr});
    p->transfer.reset(new P2pTransfer(*c->ctx, c->p2p_seq, p->op));
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

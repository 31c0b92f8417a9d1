/*
 * gloo_shim.h: a plain C interface over the parts of Gloo (libgloo 0.5) that backend-gloo uses.
 *
 * Rules of the interface:
 *  - No C++ exception ever leaves a gloo_shim_* function: every function that can fail returns
 *    a status code (GLOO_SHIM_OK = 0) and fills the caller's gloo_shim_status with Gloo's
 *    message (and, for communication failures, the rank of the failed peer when known).
 *  - Objects are opaque handles created by *_new / *_connect and released by *_free.
 *  - Buffers are (pointer, byte or element count) pairs owned by the caller, which keeps them
 *    alive and unaliased for the duration of the call (all calls here are blocking).
 *  - The shim does no arithmetic: reductions call the caller's gloo_shim_reduce_fn, on the
 *    thread that called gloo_shim_allreduce / gloo_shim_reduce_scatter, before that call
 *    returns.
 */
#ifndef GLOO_SHIM_H
#define GLOO_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. */
enum {
  GLOO_SHIM_OK = 0,
  /* A timeout (store wait, connect, send/recv wait). */
  GLOO_SHIM_TIMEOUT = 1,
  /* An I/O failure (a peer closed the connection, reset, ...). */
  GLOO_SHIM_IO = 2,
  /* A Gloo precondition (GLOO_ENFORCE) failed. */
  GLOO_SHIM_ENFORCE = 3,
  /* An invalid argument caught by the shim itself. */
  GLOO_SHIM_INVALID = 4,
  /* Any other C++ exception. */
  GLOO_SHIM_OTHER = 5,
  /* A rendezvous key that must be new already exists in the store (a reused job id). */
  GLOO_SHIM_KEY_EXISTS = 6,
  /* The caller's output buffer is too small (the needed size is reported). */
  GLOO_SHIM_TOO_SMALL = 7,
  /* A point-to-point wait ended because gloo_shim_context_abort_waits was called. */
  GLOO_SHIM_ABORTED = 8
};

/* Element types (backend-gloo maps grid_core::DType to these explicitly). The shim only needs
 * each one's size; reductions happen in the caller's gloo_shim_reduce_fn. BOOL is one byte
 * (any value; non-zero is true); the fp8 types are one opaque byte each (moved, never reduced
 * by backend-gloo). */
enum {
  GLOO_SHIM_F32 = 0,
  GLOO_SHIM_F64 = 1,
  GLOO_SHIM_I32 = 2,
  GLOO_SHIM_I64 = 3,
  GLOO_SHIM_U8 = 4,
  GLOO_SHIM_F16 = 5,
  GLOO_SHIM_BF16 = 6,
  GLOO_SHIM_I8 = 7,
  GLOO_SHIM_U32 = 8,
  GLOO_SHIM_U64 = 9,
  GLOO_SHIM_BOOL = 10,
  GLOO_SHIM_F8E4M3 = 11,
  GLOO_SHIM_F8E5M2 = 12
};

/* Reductions. */
enum {
  GLOO_SHIM_SUM = 0,
  GLOO_SHIM_PROD = 1,
  GLOO_SHIM_MIN = 2,
  GLOO_SHIM_MAX = 3
};

/* Allreduce algorithms (gloo::AllreduceOptions::Algorithm). */
enum {
  GLOO_SHIM_ALLREDUCE_RING = 1,
  GLOO_SHIM_ALLREDUCE_BCUBE = 2
};

/* Reduce-scatter algorithms. */
enum {
  /* gloo::ReduceScatterHalvingDoubling<T> (the legacy algorithm; pair-bound buffers). */
  GLOO_SHIM_RS_HALVING_DOUBLING = 1,
  /* gloo::allreduce (ring) on a scratch copy, then a copy of this rank's block. */
  GLOO_SHIM_RS_ALLREDUCE = 2,
  /* The shim's ring reduce-scatter over Gloo's unbound buffers: each rank sends n - 1 blocks
   * (half an all-reduce's traffic) and stages two blocks, not the whole input. */
  GLOO_SHIM_RS_RING = 3
};

/* The element-wise reduction Gloo runs: out[i] = a[i] op b[i] for n elements of dtype
 * (GLOO_SHIM_F32.., GLOO_SHIM_SUM..). out may be equal to a or to b. Must not throw or unwind;
 * it cannot report a failure through Gloo, so the caller records one on its own side. */
typedef void (*gloo_shim_reduce_fn)(
    int32_t dtype, int32_t op, void* out, const void* a, const void* b, size_t n);

#define GLOO_SHIM_MESSAGE_LEN 2048

typedef struct gloo_shim_status {
  int32_t code;
  /* Rank (in the context) of the peer whose connection failed, or -1. */
  int32_t peer;
  /* NUL-terminated message (truncated to fit). */
  char message[GLOO_SHIM_MESSAGE_LEN];
} gloo_shim_status;

typedef struct gloo_shim_store gloo_shim_store;
typedef struct gloo_shim_device gloo_shim_device;
typedef struct gloo_shim_context gloo_shim_context;
typedef struct gloo_shim_pending gloo_shim_pending;

/* One point-to-point operation (gloo_shim_p2p, gloo_shim_post).
 *
 * Every message carries a header with its element type and count (the shim's length protocol,
 * see "point to point" below), so a receive gets exactly the message it posted or is told what
 * arrived instead; Gloo never sees a message longer than the memory posted for it. */
typedef struct gloo_shim_p2p_op {
  /* 0 = send, 1 = recv. */
  int32_t is_recv;
  int32_t peer;
  uint32_t tag;
  /* Element type (GLOO_SHIM_F32..) and count of ptr; bytes = count * element size. */
  int32_t dtype;
  size_t count;
  void* ptr;
  size_t bytes;
  /* Outputs, set when the call returns GLOO_SHIM_OK: mismatch = 1 when the two sides of the
   * message disagreed on its element type or count; other_dtype and other_count then give the
   * other side's: for a receive, what the sender sent (the message was consumed and discarded,
   * ptr is untouched); for a send of more than GLOO_SHIM_P2P_INLINE_MAX bytes, what the
   * receiver posted (the receiver discarded the message). A send of up to
   * GLOO_SHIM_P2P_INLINE_MAX bytes is not told. The connection stays usable either way. */
  int32_t mismatch;
  int32_t other_dtype;
  uint64_t other_count;
  /* Input, receives only (0 for sends): when 1 and an inline message (at most
   * GLOO_SHIM_P2P_INLINE_MAX bytes, + GLOO_SHIM_CHECK_INLINE_EXTRA on the check's slots) of the
   * same element type but another count arrives, its
   * first min(sent, posted) elements are still copied into ptr (mismatch = 1 and other_count
   * report the whole message). The mismatch check's messages all begin with the sender's
   * fingerprint, which a receiver then reads whatever the rest of the message is. */
  int32_t keep_prefix;
  /* Framed messages (grid-core's P2pOp::SendFramed / RecvFramed): head_bytes bytes at head (at
   * most GLOO_SHIM_FRAME_HEAD_MAX) travel in front of the payload in the same message (in the
   * header message of a chunked payload), so a small fixed-size header costs no message of its
   * own. 0: a plain message. A receive posts the header length it expects and gets the sender's
   * header copied to head. When the two header lengths differ, mismatch = 1 and other_head
   * gives the other side's (a receive: what the sender framed; a chunked send: what the
   * receiver posted); nothing is written, as for another count. */
  void* head;
  size_t head_bytes;
  uint64_t other_head;
} gloo_shim_p2p_op;

/* ---- stores ---------------------------------------------------------------------------------- */

/* An in-memory store (gloo::rendezvous::HashStore), thread safe: share it between the ranks of
 * one process with gloo_shim_store_clone. */
int32_t gloo_shim_store_hash_new(gloo_shim_store** out, gloo_shim_status* st);
/* A store in a directory (gloo::rendezvous::FileStore); the directory must exist. */
int32_t gloo_shim_store_file_new(const char* path, gloo_shim_store** out, gloo_shim_status* st);
/* A Redis store (gloo::rendezvous::RedisStore); connects at once (2 s connect timeout). */
int32_t gloo_shim_store_redis_new(
    const char* host, int32_t port, gloo_shim_store** out, gloo_shim_status* st);
/* A second handle to the same store. */
gloo_shim_store* gloo_shim_store_clone(const gloo_shim_store* store);
void gloo_shim_store_free(gloo_shim_store* store);
/* Sets prefix/key (fails with GLOO_SHIM_KEY_EXISTS if the key exists). */
int32_t gloo_shim_store_set(
    gloo_shim_store* store, const char* prefix, const char* key, const void* data, size_t len,
    gloo_shim_status* st);
/* Waits up to timeout_ms for prefix/key and copies its value into buf (capacity cap); *len
 * receives the value's length. GLOO_SHIM_TOO_SMALL when cap < *len (nothing copied). */
/* Number of keys in the store, where it can tell (the in-memory store); -1 otherwise. */
int64_t gloo_shim_store_count(const gloo_shim_store* store);
int32_t gloo_shim_store_get(
    gloo_shim_store* store, const char* prefix, const char* key, int64_t timeout_ms, void* buf,
    size_t cap, size_t* len, gloo_shim_status* st);
/* Reads prefix/key without waiting: *found = 1 and the value as in gloo_shim_store_get if the
 * key exists, *found = 0 otherwise. */
int32_t gloo_shim_store_try_get(
    gloo_shim_store* store, const char* prefix, const char* key, void* buf, size_t cap,
    size_t* len, int32_t* found, gloo_shim_status* st);
/* Bounds every later request of this handle to a store server (Redis) to timeout_ms
 * (0: no bound); no effect on the in-memory and file stores, which never block on a server. */
int32_t gloo_shim_store_set_io_timeout(
    gloo_shim_store* store, int64_t timeout_ms, gloo_shim_status* st);

/* ---- devices and contexts ------------------------------------------------------------------- */

/* A TCP device bound to hostname (an address of this host, e.g. "127.0.0.1"). */
int32_t gloo_shim_device_tcp_new(
    const char* hostname, gloo_shim_device** out, gloo_shim_status* st);
void gloo_shim_device_free(gloo_shim_device* device);

/* Rendezvous of `size` ranks under the store key prefix `prefix` (full mesh of TCP pairs).
 * The whole rendezvous (arrival of every rank, address exchange, connections, closing barrier)
 * ends within timeout_ms (one deadline; a store server request may add up to one second),
 * and later operations on the context default to it. On a timeout the message lists the ranks
 * that never arrived or never connected, and st->peer is the rank blamed when exactly one is
 * known. A rank that fails after every rank arrived announces it in the store, and the ranks
 * still waiting fail at once with its cause.
 * group != 0: a group of a communicator that is already connected (its members and their number
 * come from it). Its rendezvous skips the arrival phase (one store synchronisation fewer; a
 * member that never comes is blamed by name), and once it completed on every member (after
 * the closing barrier) the keys this rank set are removed from the store. group == 0 (a world):
 * the keys stay, marking the job id as used. */
int32_t gloo_shim_context_connect(
    gloo_shim_store* store, const char* prefix, gloo_shim_device* device, int32_t rank,
    int32_t size, int64_t timeout_ms, int32_t group, gloo_shim_context** out,
    gloo_shim_status* st);
void gloo_shim_context_free(gloo_shim_context* ctx);
/* on != 0 (the default): while one of libgloo's collectives runs on this context, the TCP
 * device's loop thread polls, giving its core away between polls (sched_yield), instead of
 * sleeping in epoll_wait. libgloo's loop only try-locks a pair that a user thread holds, and
 * spins while it fails: if its wake-up took the core from that thread, the lock comes back at
 * the scheduler's next tick (4 ms here). Polling costs the loop thread's share of a core for
 * the collective's duration. The shim's point-to-point posts always yield this way (for
 * microseconds). Thread-safe. */
void gloo_shim_context_set_busy_poll(gloo_shim_context* ctx, int32_t on);
/* 1 if libgloo's collectives on this context run with the loop thread polling (see above), 0
 * if not. Thread-safe. */
int32_t gloo_shim_context_busy_poll(const gloo_shim_context* ctx);
/* Busy polling (above) only for libgloo's collectives whose largest buffer (bytes: the
 * all-reduce's, broadcast's and all-to-all's buffer, the all-gather's output, the
 * reduce-scatter's input) is smaller than `bytes`; the others let the loop thread sleep in
 * epoll_wait. SIZE_MAX (the default): every collective polls while busy polling is on.
 * Thread-safe. */
void gloo_shim_context_set_busy_poll_below(gloo_shim_context* ctx, size_t bytes);
/* The limit set above (SIZE_MAX unless set). Thread-safe. */
size_t gloo_shim_context_busy_poll_below(const gloo_shim_context* ctx);
/* Closes every connection of the context at once (a hard close: the peers see their
 * connections reset). For a context that failed: the peers blocked on this rank wake up now
 * instead of at their timeout. Operations on the context fail afterwards. */
void gloo_shim_context_close(gloo_shim_context* ctx);

/* Wakes every wait of this context and makes every later one fail at once: point-to-point
 * waits (blocking or posted) end with GLOO_SHIM_ABORTED (Gloo's abortWaitRecv/abortWaitSend);
 * every TCP pair is then failed as a lost connection would fail it
 * (tcp::Pair::signalExceptionExternal), which wakes the waits of a collective inside Gloo's
 * algorithms with an I/O error and closes the pair. Thread-safe, idempotent, never throws. */
void gloo_shim_context_abort_waits(gloo_shim_context* ctx);
int32_t gloo_shim_context_rank(const gloo_shim_context* ctx);
int32_t gloo_shim_context_size(const gloo_shim_context* ctx);

/* ---- collectives (blocking; count = elements, bytes = bytes) --------------------------------- */

/* recv[i] = op over ranks of send[i], reduced with `reduce`; send and recv have count elements
 * of dtype. send == recv reduces in place. algorithm: GLOO_SHIM_ALLREDUCE_*;
 * max_segment_bytes: the ring's largest segment (the unit it overlaps sending with reducing;
 * rounded to whole elements), 0 for Gloo's default (1 MiB); ignored by BCube. */
int32_t gloo_shim_allreduce(
    gloo_shim_context* ctx, const void* send, void* recv, size_t count, int32_t dtype,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, size_t max_segment_bytes,
    uint32_t tag, int64_t timeout_ms, gloo_shim_status* st);
/* buf (bytes) of rank root to every rank, in place. */
int32_t gloo_shim_broadcast(
    gloo_shim_context* ctx, void* buf, size_t bytes, int32_t root, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st);
/* recv (size * bytes) = concatenation of every rank's send (bytes). send == NULL: in place,
 * recv already holds this rank's block at rank * bytes (Gloo gets no input and copies
 * nothing). */
int32_t gloo_shim_allgather(
    gloo_shim_context* ctx, const void* send, void* recv, size_t bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st);
/* recv (recv_count elements) = block `rank` of op over ranks of send (size * recv_count),
 * reduced with `reduce`. algorithm: GLOO_SHIM_RS_*; allreduce_algorithm and
 * max_segment_bytes: the all-reduce that GLOO_SHIM_RS_ALLREDUCE runs (as in
 * gloo_shim_allreduce). recv may be send + rank * recv_count (NCCL's in-place form; send is
 * then writable and its other blocks are left unspecified): every algorithm reads this rank's
 * input block only before, or element by element while, it writes the result there (the ring
 * reduces it into itself at its last step; the others reduce a copy first). */
int32_t gloo_shim_reduce_scatter(
    gloo_shim_context* ctx, const void* send, void* recv, size_t recv_count, int32_t dtype,
    int32_t op, gloo_shim_reduce_fn reduce, int32_t algorithm, int32_t allreduce_algorithm,
    size_t max_segment_bytes, uint32_t tag, int64_t timeout_ms, gloo_shim_status* st);
/* Block j of send (bytes / size) to rank j; block i of recv from rank i. */
int32_t gloo_shim_alltoall(
    gloo_shim_context* ctx, const void* send, void* recv, size_t bytes, uint32_t tag,
    int64_t timeout_ms, gloo_shim_status* st);
int32_t gloo_shim_barrier(
    gloo_shim_context* ctx, uint32_t tag, int64_t timeout_ms, gloo_shim_status* st);

/* ---- point to point --------------------------------------------------------------------------- *
 *
 * The length protocol. A send of B bytes travels as:
 *  - B <= GLOO_SHIM_P2P_INLINE_MAX: ONE Gloo message, header + payload (copied through a staging
 *    buffer on both sides), on the slot of the tag;
 *  - larger: the header alone on the slot of the tag, then the payload straight from the
 *    caller's memory (no copy) in chunks of at most GLOO_SHIM_P2P_CHUNK bytes on a payload slot
 *    that the header names (unique per message of the sending context, so messages of one
 *    pair and tag can never take each other's payload).
 * A framed message carries up to GLOO_SHIM_FRAME_HEAD_MAX bytes of the caller's own header
 * between the protocol's header and the payload (inline or not).
 * A receive always posts a staging buffer of GLOO_SHIM_P2P_INLINE_MAX + GLOO_SHIM_FRAME_HEAD_MAX
 * + header bytes for the first message (the largest a sender can make it), reads the header,
 * then copies the inline
 * payload, or receives the chunks straight into the caller's memory; if the element type or
 * count differs from the receive's, it drains the payload (inline: nothing to do; chunks:
 * through one chunk of scratch memory), leaves the caller's memory untouched and reports the
 * mismatch in the op's outputs. For a chunked message the receiver also answers on a reply
 * slot (posted by the sender before its header left: the answer never waits) with what it
 * posted, so the sender's send reports the mismatch too; the answer travels while the payload
 * does, so it adds no round trip. A send of up to GLOO_SHIM_P2P_INLINE_MAX bytes succeeds
 * (as MPI's does): waiting for an answer would double its latency. Headers, chunks and
 * answers of one pair and tag keep their order (Gloo matches messages of one slot first in,
 * first out; chunks and answers have slots unique to their message). */

/* Largest payload sent inline with its header (bytes). */
#define GLOO_SHIM_P2P_INLINE_MAX (64u * 1024u)
/* gloo_shim_check_exchange's messages may be this much longer inline: a fingerprint of 8
 * integers before a payload of up to GLOO_SHIM_P2P_INLINE_MAX bytes. */
#define GLOO_SHIM_CHECK_INLINE_EXTRA 64u
/* Largest header of a framed message (bytes). */
#define GLOO_SHIM_FRAME_HEAD_MAX 64u
/* Bytes of libgloo's TCP framing before every message's payload in the stream: the preamble of
 * gloo::transport::tcp::Op, six size_t (gloo/transport/tcp/pair.h; Debian's libgloo-dev cannot
 * include that header, it names one the package lacks, so the figure is written here). */
#define GLOO_SHIM_TCP_PREAMBLE 48u
/* Largest chunk of a large payload (bytes). */
#define GLOO_SHIM_P2P_CHUNK (4u * 1024u * 1024u)
/* gloo_shim_broadcast of this many bytes or more runs without busy polling on any context
 * (backend-gloo's BROADCAST_BUSY_POLL_BELOW; other collectives follow the context's limit,
 * gloo_shim_context_set_busy_poll_below). */
#define GLOO_SHIM_BROADCAST_BUSY_POLL_BELOW (64u * 1024u * 1024u)

/* Posts every operation of ops (in order), then waits for all of them. On failure the remaining
 * operations are cancelled before returning: no buffer is touched after the call returns. A
 * receive whose message does not match it is not a failure: see the op's outputs. */
int32_t gloo_shim_p2p(
    gloo_shim_context* ctx, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st);
/* gloo_shim_p2p for the messages of a collective that the caller builds from point-to-point
 * messages (backend-gloo's all-to-all-v, all-gather-v, reduce-scatter-v, reduce, gather,
 * scatter): the same length protocol, posting and cancellation, but each op's tag is the
 * collective's tag and the headers travel on a slot prefix of their own (never a user tag's
 * and never one of Gloo's collectives'), so user point-to-point messages can never match them.
 * A receive whose message does not match it (another element type or count: ranks that
 * disagree on the counts) is reported in the op's outputs exactly as for gloo_shim_p2p; no
 * buffer is touched beyond the memory each op names. */
int32_t gloo_shim_exchange(
    gloo_shim_context* ctx, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st);
/* gloo_shim_exchange for the mismatch check's messages (backend-gloo's check of a collective,
 * which runs under that collective's tag right before it): headers on a slot prefix of their
 * own, so they never meet the checked collective's messages. */
int32_t gloo_shim_check_exchange(
    gloo_shim_context* ctx, gloo_shim_p2p_op* ops, size_t n, int64_t timeout_ms,
    gloo_shim_status* st);
/* Posts one operation and returns a handle to wait on; the memory must stay valid until the
 * handle is freed (gloo_shim_pending_free cancels the operation if it is still pending). */
int32_t gloo_shim_post(
    gloo_shim_context* ctx, const gloo_shim_p2p_op* op, gloo_shim_pending** out,
    gloo_shim_status* st);
/* Payload bytes this process has copied through staging or scratch memory for point-to-point
 * messages so far (both sides of inline messages, drained payloads); large matching messages
 * add nothing (they are never copied). A diagnostic for tests and benchmarks. */
uint64_t gloo_shim_p2p_copied_bytes(void);
/* Waits for a posted operation; on GLOO_SHIM_OK, *result receives the op with its outputs. */
int32_t gloo_shim_pending_wait(
    gloo_shim_pending* pending, int64_t timeout_ms, gloo_shim_p2p_op* result,
    gloo_shim_status* st);
void gloo_shim_pending_free(gloo_shim_pending* pending);

#ifdef __cplusplus
}
#endif

#endif /* GLOO_SHIM_H */

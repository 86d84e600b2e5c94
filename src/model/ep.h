/* Expert parallelism (issue 13): the exchange of a MoE layer's rows between ranks that each own a
 * contiguous range of the routed experts (vLLM / SGLang "EP": all-to-all dispatch, the experts run
 * where their weights are, all-to-all combine), over a transport interface: an in-process loopback
 * of N ranks (threads; what `make test` runs) and NCCL between the CUDA devices of this process
 * (ep_nccl.c; docs/EP.md). The exchange moves host memory: the CPU backend's buffers, or CUDA's
 * staged through the host (forward.c); the forward calls ep_moe_exchange in its MoE layers when the
 * batch is a rank of an fp4moe_ep_group. */
#ifndef FP4MOE_MODEL_EP_H
#define FP4MOE_MODEL_EP_H

#include <stddef.h>
#include <stdint.h>

typedef struct ep_transport ep_transport;
typedef struct ep_dev_io ep_dev_io;
struct ep_transport {
    int rank, world;
    /* Collective (every rank of the world calls it, in the same order): send_bytes[d] bytes to each
     * rank d, the pieces concatenated in rank order in `send`; what rank s sends to this rank lands
     * in `recv`, concatenated in rank order, recv_bytes[s] bytes each. Errors: FP4MOE_EOVERFLOW
     * when more than recv_cap bytes arrive (after taking part, so that no rank waits forever). */
    int (*alltoallv)(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                     int64_t recv_cap, int64_t *recv_bytes);
    /* The same collective on backend (device) memory with the byte counts known on both sides
     * (recv_bytes[s]: what rank s sends here, from an alltoallv of the counts): io->copy(io->ctx,
     * dst, src, n) copies between two ranks' buffers on the calling rank's stream and io->wait
     * waits for its copies (the loopback uses them; NCCL moves the bytes itself). The caller's
     * writes to `send` must be complete (waited for) before the call; `recv` is complete when it
     * returns. */
    int (*alltoallv_dev)(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                         const int64_t *recv_bytes, const ep_dev_io *io);
    void *impl;
};
struct ep_dev_io {
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    int (*wait)(void *ctx);
    void *ctx;
};

/* world (1..64) ranks in one process: ranks[r] for r < world share one exchange, and each must be
 * driven by its own thread (an exchange returns when every rank has called it). Errors:
 * FP4MOE_EINVAL (world), FP4MOE_ENOMEM. ep_loopback_free frees all of them. */
int ep_loopback_create(int world, ep_transport **ranks);
void ep_loopback_free(ep_transport **ranks, int world);

/* world (1..64) ranks in this process over NCCL (src/model/ep_nccl.c), rank r on CUDA device
 * devices[r] (NULL: device r; one device per rank), each driven by its own thread; host memory in
 * and out (staged through a device buffer of the rank). libnccl.so.2 is opened at run time.
 * Errors: FP4MOE_EUNSUPPORTED (no CUDA build, NCCL not found: the message says where to put it),
 * FP4MOE_EINVAL (world, devices), FP4MOE_ECUDA (NCCL's or CUDA's error), FP4MOE_ENOMEM. */
int ep_nccl_create(int world, const int *devices, ep_transport **ranks);
void ep_nccl_free(ep_transport **ranks, int world);
/* NCCL's version code (e.g. 22703 for 2.27.3), 0 when it cannot be opened. */
int ep_nccl_version(void);

/* The routed experts [*lo, *hi) of rank r: contiguous ranges, floor(r * E / world) .. floor((r+1) *
 * E / world) (E not divisible by world: some ranks own one expert more; world > E: some none). */
void ep_expert_range(int64_t E, int world, int rank, int64_t *lo, int64_t *hi);

/* Grow-only buffers kept from one MoE layer to the next (a batch owns one): slot i holds at least
 * the largest size asked of it. ep_scratch_get returns NULL when out of memory. */
typedef struct {
    void *p[8];
    size_t cap[8];
} ep_scratch;
void *ep_scratch_get(ep_scratch *s, int slot, size_t bytes);
void ep_scratch_free(ep_scratch *s);

/* Computes the rows a rank owns: y (n rows) = the experts idx[i] (global ids, non-decreasing, all
 * in the rank's range) applied to x (n rows). Returns an fp4moe status. */
typedef int (*ep_expert_fn)(void *ctx, const void *x, const uint32_t *idx, int64_t n, void *y);

/* One rank's routed-expert step (collective): rows xs (B rows of in_row bytes; idx[b] the expert of
 * row b, non-decreasing, >= E for rows that go nowhere) go to the ranks that own their experts,
 * which run fn on everything they received (sorted by expert, stably: rank order, then row order),
 * and the results (out_row bytes a row) come back into ys in the original row order; rows with
 * idx >= E are zeros (the gather_qmm contract). Every output byte equals what one rank computing
 * all rows gets whenever fn's result for a row does not depend on the other rows. Errors:
 * FP4MOE_EINVAL (idx not sorted), FP4MOE_ENOMEM, fn's, the transport's; on an error every rank
 * still takes part in every exchange of the step. ws: slots 0..6 for the received rows, their sorted
 * copies and results (NULL: buffers of this call only). */
int ep_moe_exchange(ep_transport *t, int64_t E, const uint32_t *idx, const void *xs, int64_t B, size_t in_row,
                    size_t out_row, ep_expert_fn fn, void *ctx, void *ys, ep_scratch *ws);

/* The status exchange alone (collective): every rank's st; the first failure (lowest rank) is
 * returned on every rank, FP4MOE_OK when none failed. */
int ep_moe_exchange_fail_if(ep_transport *t, int st);

/* The transport of rank `rank` of a public group (fp4moe_ep_group_new), NULL when out of range. */
struct fp4moe_ep_group;
ep_transport *ep_group_rank(struct fp4moe_ep_group *g, int rank);

#endif

/* Expert parallelism: the loopback transport and the dispatch / compute / combine of a MoE layer's
 * rows (src/model/ep.h). */
#define _POSIX_C_SOURCE 200809L

#include "model/ep.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/model.h"

/* ---- loopback: N ranks in one process ------------------------------------------------------ */

typedef struct {
    int world;
    pthread_barrier_t bar;
    struct {
        const char *send;
        const int64_t *send_bytes;
    } slot[64];
} lb_shared;

/* One exchange: every rank posts its pieces, then copies what is addressed to it. Host memory
 * (io NULL: memcpy, recv_cap checked, recv_bytes written) or backend memory (io: copies on the
 * rank's stream, then a wait; expect: the sizes the caller knows, checked). */
static int lb_exchange(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv, int64_t recv_cap,
                       int64_t *recv_bytes, const int64_t *expect, const ep_dev_io *io) {
    lb_shared *sh = t->impl;
    sh->slot[t->rank].send = send;
    sh->slot[t->rank].send_bytes = send_bytes;
    pthread_barrier_wait(&sh->bar); /* every rank's pieces are posted (and complete: see ep.h) */
    int st = FP4MOE_OK;
    int64_t off = 0;
    for (int s = 0; s < sh->world; s++) {
        const int64_t *sb = sh->slot[s].send_bytes;
        int64_t start = 0;
        for (int d = 0; d < t->rank; d++) start += sb[d];
        const int64_t n = sb[t->rank];
        if (recv_bytes) recv_bytes[s] = n;
        if (expect && n != expect[s]) {
            if (!st) st = fp4moe_set_error(FP4MOE_EINVAL, "ep loopback: rank %d expects %lld bytes from rank %d, "
                                           "which sends %lld", t->rank, (long long)expect[s], s, (long long)n);
        } else if (!expect && off + n > recv_cap) {
            if (!st) st = fp4moe_set_error(FP4MOE_EOVERFLOW, "ep loopback: rank %d receives more than %lld bytes",
                                           t->rank, (long long)recv_cap);
        } else if (n && !st) {
            if (io) st = io->copy(io->ctx, (char *)recv + off, sh->slot[s].send + start, (size_t)n);
            else memcpy((char *)recv + off, sh->slot[s].send + start, (size_t)n);
        }
        off += expect ? expect[s] : n;
    }
    if (io) { /* this rank's copies have landed */
        const int wst = io->wait(io->ctx);
        if (!st) st = wst;
    }
    pthread_barrier_wait(&sh->bar); /* every rank has copied: the senders may reuse their buffers */
    return st;
}

static int lb_alltoallv(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                        int64_t recv_cap, int64_t *recv_bytes) {
    return lb_exchange(t, send, send_bytes, recv, recv_cap, recv_bytes, NULL, NULL);
}

static int lb_alltoallv_dev(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                            const int64_t *recv_bytes, const ep_dev_io *io) {
    return lb_exchange(t, send, send_bytes, recv, 0, NULL, recv_bytes, io);
}

int ep_loopback_create(int world, ep_transport **ranks) {
    if (world < 1 || world > 64) return fp4moe_set_error(FP4MOE_EINVAL, "ep loopback: %d ranks (1..64)", world);
    lb_shared *sh = calloc(1, sizeof *sh);
    ep_transport *t = calloc((size_t)world, sizeof *t);
    if (!sh || !t || pthread_barrier_init(&sh->bar, NULL, (unsigned)world)) {
        free(sh);
        free(t);
        return fp4moe_set_error(FP4MOE_ENOMEM, "ep loopback: cannot make %d ranks", world);
    }
    sh->world = world;
    for (int r = 0; r < world; r++) {
        t[r] = (ep_transport){r, world, lb_alltoallv, lb_alltoallv_dev, sh};
        ranks[r] = &t[r];
    }
    return FP4MOE_OK;
}

void ep_loopback_free(ep_transport **ranks, int world) {
    if (!ranks || world < 1 || !ranks[0]) return;
    lb_shared *sh = ranks[0]->impl;
    pthread_barrier_destroy(&sh->bar);
    free(sh);
    free(ranks[0]); /* the array of all ranks */
    for (int r = 0; r < world; r++) ranks[r] = NULL;
}

/* ---- expert ownership ---------------------------------------------------------------------- */

void ep_expert_range(int64_t E, int world, int rank, int64_t *lo, int64_t *hi) {
    *lo = rank * E / world;
    *hi = (rank + 1) * E / world;
}

static int owner_of(int64_t E, int world, int64_t e) { /* the rank whose range holds e < E */
    int r = (int)(e * world / E);
    int64_t lo, hi;
    for (;;) { /* floor division can land one rank off: step to the range that holds e */
        ep_expert_range(E, world, r, &lo, &hi);
        if (e < lo) r--;
        else if (e >= hi) r++;
        else return r;
    }
}

/* ---- the routed-expert step ----------------------------------------------------------------- */

/* A collective status: every rank's st, the first failure wins on every rank. */
static int agree(ep_transport *t, int st) {
    int64_t mine[64], all[64], nb[64], rb[64];
    for (int d = 0; d < t->world; d++) {
        mine[d] = st;
        nb[d] = (int64_t)sizeof(int64_t);
    }
    const int tst = t->alltoallv(t, mine, nb, all, (int64_t)sizeof all, rb);
    if (tst) return tst;
    for (int s = 0; s < t->world; s++)
        if (all[s]) return s == t->rank ? (int)all[s]
                                        : fp4moe_set_error((int)all[s], "ep: rank %d failed in this MoE step", s);
    return FP4MOE_OK;
}

void *ep_scratch_get(ep_scratch *s, int slot, size_t bytes) {
    if (bytes > s->cap[slot]) {
        free(s->p[slot]);
        s->cap[slot] = 0;
        if (!(s->p[slot] = malloc(bytes))) return NULL;
        s->cap[slot] = bytes;
    }
    return s->p[slot];
}

void ep_scratch_free(ep_scratch *s) {
    for (int i = 0; i < 8; i++) free(s->p[i]);
    memset(s, 0, sizeof *s);
}

int ep_moe_exchange(ep_transport *t, int64_t E, const uint32_t *idx, const void *xs, int64_t B, size_t in_row,
                    size_t out_row, ep_expert_fn fn, void *ctx, void *ys, ep_scratch *ws) {
    const int W = t->world;
    int64_t cnt[64] = {0}, rcnt[64], sb[64], rb[64];
    int st = FP4MOE_OK;
    int64_t nin = 0; /* rows with idx < E: the sorted prefix */
    for (int64_t b = 0; b < B; b++) {
        if (b && idx[b] < idx[b - 1] && !st)
            st = fp4moe_set_error(FP4MOE_EINVAL, "ep: idx not sorted at row %lld", (long long)b);
        if (idx[b] < (uint64_t)E) {
            cnt[owner_of(E, W, idx[b])]++;
            nin++;
        }
    }
    if (st) memset(cnt, 0, sizeof cnt);
    /* 1. counts (and a failure before them) */
    for (int d = 0; d < W; d++) sb[d] = (int64_t)sizeof(int64_t);
    int tst = t->alltoallv(t, cnt, sb, rcnt, (int64_t)sizeof rcnt, rb);
    if ((st = agree(t, st ? st : tst))) return st;
    int64_t nrecv = 0;
    for (int s = 0; s < W; s++) nrecv += rcnt[s];
    ep_scratch own = {{0}, {0}}, *S = ws ? ws : &own;
    char *xr = ep_scratch_get(S, 0, (size_t)nrecv * in_row + 1), *xsort = ep_scratch_get(S, 1, (size_t)nrecv * in_row + 1);
    char *yr = ep_scratch_get(S, 2, (size_t)nrecv * out_row + 1), *ysort = ep_scratch_get(S, 3, (size_t)nrecv * out_row + 1);
    uint32_t *ir = ep_scratch_get(S, 4, (size_t)nrecv * sizeof *ir + 1);
    uint32_t *isort = ep_scratch_get(S, 5, (size_t)nrecv * sizeof *isort + 1);
    int64_t *perm = ep_scratch_get(S, 6, (size_t)nrecv * sizeof *perm + 1);
    if (!xr || !xsort || !yr || !ysort || !ir || !isort || !perm)
        st = fp4moe_set_error(FP4MOE_ENOMEM, "ep: %lld received rows", (long long)nrecv);
    if (!(st = agree(t, st))) {
        /* 2. the rows and their experts (the rows for rank d are contiguous: experts ascend with d) */
        for (int d = 0; d < W; d++) sb[d] = cnt[d] * (int64_t)sizeof(uint32_t);
        st = t->alltoallv(t, idx, sb, ir, nrecv * (int64_t)sizeof(uint32_t), rb);
        for (int d = 0; d < W; d++) sb[d] = cnt[d] * (int64_t)in_row;
        tst = t->alltoallv(t, xs, sb, xr, nrecv * (int64_t)in_row, rb);
        if (!st) st = tst;
        /* 3. the owned experts on everything received, sorted stably by expert */
        int64_t lo, hi;
        ep_expert_range(E, W, t->rank, &lo, &hi);
        for (int64_t i = 0; i < nrecv && !st; i++)
            if (ir[i] < (uint64_t)lo || ir[i] >= (uint64_t)hi)
                st = fp4moe_set_error(FP4MOE_EINVAL, "ep: rank %d received expert %u outside its %lld..%lld",
                                      t->rank, ir[i], (long long)lo, (long long)hi - 1);
        if (!st) {
            int64_t *start = calloc((size_t)(hi - lo + 1), sizeof *start);
            if (!start) {
                st = fp4moe_set_error(FP4MOE_ENOMEM, "ep: sort of %lld rows", (long long)nrecv);
            } else {
                for (int64_t i = 0; i < nrecv; i++) start[ir[i] - lo + 1]++;
                for (int64_t e = 0; e < hi - lo; e++) start[e + 1] += start[e];
                for (int64_t i = 0; i < nrecv; i++) {
                    const int64_t p = start[ir[i] - lo]++;
                    perm[i] = p;
                    isort[p] = ir[i];
                    memcpy(xsort + p * in_row, xr + i * in_row, in_row);
                }
                free(start);
                if (nrecv) st = fn(ctx, xsort, isort, nrecv, ysort);
                for (int64_t i = 0; i < nrecv && !st; i++) {
#ifdef FP4MOE_INJECT_FAULT_EP_ORDER /* deliberate fault (tests must catch it): results back in sorted order */
                    memcpy(yr + i * out_row, ysort + i * out_row, out_row);
#else
                    memcpy(yr + i * out_row, ysort + perm[i] * out_row, out_row);
#endif
                }
            }
        }
        /* 4. the results back, in the order they came (so in this rank's row order) */
        if (!(st = agree(t, st))) {
            for (int s = 0; s < W; s++) sb[s] = rcnt[s] * (int64_t)out_row;
            st = t->alltoallv(t, yr, sb, ys, nin * (int64_t)out_row, rb);
            if (!st) memset((char *)ys + nin * out_row, 0, (size_t)(B - nin) * out_row);
        }
    }
    if (!ws) ep_scratch_free(&own);
    return st;
}

int ep_moe_exchange_fail_if(ep_transport *t, int st) { return agree(t, st); }

/* ---- the public group ---------------------------------------------------------------------------- */

struct fp4moe_ep_group {
    int world;
    int nccl;                       /* 1: ep_nccl_create, 0: ep_loopback_create */
    ep_transport *ranks[64];
};

static int group_new(int world, int nccl, const int *devices, fp4moe_ep_group **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "ep_group_new: NULL argument");
    *out = NULL;
    fp4moe_ep_group *g = calloc(1, sizeof *g);
    if (!g) return fp4moe_set_error(FP4MOE_ENOMEM, "ep_group_new: out of memory");
    const int st = nccl ? ep_nccl_create(world, devices, g->ranks) : ep_loopback_create(world, g->ranks);
    if (st) {
        free(g);
        return st;
    }
    g->world = world;
    g->nccl = nccl;
    *out = g;
    return FP4MOE_OK;
}

int fp4moe_ep_group_new(int world, fp4moe_ep_group **out) { return group_new(world, 0, NULL, out); }

int fp4moe_ep_group_new_nccl(int world, const int *devices, fp4moe_ep_group **out) {
    return group_new(world, 1, devices, out);
}

int fp4moe_nccl_version(void) { return ep_nccl_version(); }

void fp4moe_ep_group_free(fp4moe_ep_group *g) {
    if (!g) return;
    if (g->nccl) ep_nccl_free(g->ranks, g->world);
    else ep_loopback_free(g->ranks, g->world);
    free(g);
}

ep_transport *ep_group_rank(fp4moe_ep_group *g, int rank) {
    return g && rank >= 0 && rank < g->world ? g->ranks[rank] : NULL;
}

void fp4moe_ep_range(int64_t E, int world, int rank, int64_t *lo, int64_t *hi) {
    ep_expert_range(E, world < 1 ? 1 : world, rank, lo, hi);
}

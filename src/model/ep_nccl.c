/* Expert parallelism over NCCL (issue 13, docs/EP.md): the ep_transport of src/model/ep.h between
 * ranks of this process on CUDA devices, ncclSend / ncclRecv in a group per exchange (NCCL's
 * documented all-to-all pattern), the byte counts exchanged first. libnccl.so.2 is opened at run
 * time (dlopen: the CUDA image's NCCL or the nvidia-nccl wheel on LD_LIBRARY_PATH), so a build or a
 * machine without NCCL keeps working and only asking for this transport fails, with a message.
 *
 * The interface moves host memory (what ep_moe_exchange works on): each exchange copies the send
 * pieces to a device buffer of the rank, runs the group of sends and receives on the rank's own
 * stream and copies the received bytes back, synchronising the stream. NVLink multicast stays off
 * (NCCL_NVLS_ENABLE=0 unless the caller set it). Multi-node (ncclCommInitRank with an id shared out
 * of band) is not built: docs/EP.md. */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "model/ep.h"

#ifdef FP4MOE_HAVE_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>

/* The few NCCL entry points used, declared here (nccl.h is not needed to build). */
typedef struct nccl_comm *nccl_comm_t;
typedef int nccl_result_t; /* ncclSuccess = 0 */
enum { NCCL_UINT8 = 1 };   /* ncclUint8 */

static struct {
    int tried, ok;
    char why[256];
    nccl_result_t (*get_version)(int *);
    nccl_result_t (*comm_init_all)(nccl_comm_t *, int, const int *);
    nccl_result_t (*comm_destroy)(nccl_comm_t);
    nccl_result_t (*group_start)(void);
    nccl_result_t (*group_end)(void);
    nccl_result_t (*send)(const void *, size_t, int, int, nccl_comm_t, cudaStream_t);
    nccl_result_t (*recv)(void *, size_t, int, int, nccl_comm_t, cudaStream_t);
    const char *(*error_string)(nccl_result_t);
} N;

static int nccl_open(void) {
    if (N.tried) return N.ok;
    N.tried = 1;
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(N.why, sizeof N.why, "libnccl.so.2 not found (%s); put NCCL's lib directory (the CUDA "
                 "image's, or the nvidia-nccl wheel's nvidia/nccl/lib) on LD_LIBRARY_PATH", dlerror());
        return 0;
    }
#define SYM(f, name)                                                                                      \
    do {                                                                                                  \
        *(void **)(&N.f) = dlsym(h, name);                                                                \
        if (!N.f) {                                                                                       \
            snprintf(N.why, sizeof N.why, "libnccl.so.2 has no %s", name);                               \
            return 0;                                                                                     \
        }                                                                                                 \
    } while (0)
    SYM(get_version, "ncclGetVersion");
    SYM(comm_init_all, "ncclCommInitAll");
    SYM(comm_destroy, "ncclCommDestroy");
    SYM(group_start, "ncclGroupStart");
    SYM(group_end, "ncclGroupEnd");
    SYM(send, "ncclSend");
    SYM(recv, "ncclRecv");
    SYM(error_string, "ncclGetErrorString");
#undef SYM
    N.ok = 1;
    return 1;
}

typedef struct {
    nccl_comm_t comm;
    int device;
    cudaStream_t stream;
    char *dsend, *drecv; /* device staging, grown on demand */
    int64_t send_cap, recv_cap;
    int64_t *dcnt;       /* 2 x world int64: counts sent, counts received */
} nccl_rank;

#define NCCL_TRY(call, what)                                                                              \
    do {                                                                                                  \
        const nccl_result_t r_ = (call);                                                                  \
        if (r_ != 0) return fp4moe_set_error(FP4MOE_ECUDA, "ep nccl (rank %d): %s: %s", t->rank, (what), \
                                             N.error_string(r_));                                         \
    } while (0)
#define CU_TRY(call, what)                                                                                \
    do {                                                                                                  \
        const cudaError_t c_ = (call);                                                                    \
        if (c_ != cudaSuccess) return fp4moe_set_error(FP4MOE_ECUDA, "ep nccl (rank %d): %s: %s", t->rank, \
                                                       (what), cudaGetErrorString(c_));                   \
    } while (0)

static int grow(ep_transport *t, char **p, int64_t *cap, int64_t need) {
    if (need <= *cap) return FP4MOE_OK;
    nccl_rank *r = t->impl;
    CU_TRY(cudaStreamSynchronize(r->stream), "stream");
    if (*p) CU_TRY(cudaFree(*p), "cudaFree");
    *p = NULL;
    *cap = 0;
    int64_t c = 1 << 20;
    while (c < need) c *= 2;
    CU_TRY(cudaMalloc((void **)p, (size_t)c), "cudaMalloc of the exchange buffer");
    *cap = c;
    return FP4MOE_OK;
}

/* One group of sends and receives of the byte counts (off: offsets, n: sizes, per peer). */
static int exchange(ep_transport *t, const char *send, const int64_t *soff, const int64_t *sn, char *recv,
                    const int64_t *roff, const int64_t *rn) {
    nccl_rank *r = t->impl;
    NCCL_TRY(N.group_start(), "ncclGroupStart");
    for (int p = 0; p < t->world; p++) {
        if (sn[p]) NCCL_TRY(N.send(send + soff[p], (size_t)sn[p], NCCL_UINT8, p, r->comm, r->stream), "ncclSend");
        if (rn[p]) NCCL_TRY(N.recv(recv + roff[p], (size_t)rn[p], NCCL_UINT8, p, r->comm, r->stream), "ncclRecv");
    }
    NCCL_TRY(N.group_end(), "ncclGroupEnd");
    return FP4MOE_OK;
}

static int nccl_alltoallv(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                          int64_t recv_cap, int64_t *recv_bytes) {
    nccl_rank *r = t->impl;
    const int W = t->world;
    int64_t soff[64], roff[64], eight[64], coff[64], rcoff[64];
    CU_TRY(cudaSetDevice(r->device), "cudaSetDevice");
    /* 1. the counts: 8 bytes to and from every peer */
    for (int p = 0; p < W; p++) {
        eight[p] = 8;
        coff[p] = 8 * p;       /* send_bytes[p] goes to peer p */
        rcoff[p] = 8 * (W + p); /* what peer p sends here lands after the sent counts */
    }
    CU_TRY(cudaMemcpyAsync(r->dcnt, send_bytes, (size_t)W * 8, cudaMemcpyHostToDevice, r->stream), "counts upload");
    int st = exchange(t, (const char *)r->dcnt, coff, eight, (char *)r->dcnt, rcoff, eight);
    if (st) return st;
    CU_TRY(cudaMemcpyAsync(recv_bytes, r->dcnt + W, (size_t)W * 8, cudaMemcpyDeviceToHost, r->stream), "counts download");
    CU_TRY(cudaStreamSynchronize(r->stream), "counts");
    /* 2. the pieces */
    int64_t stot = 0, rtot = 0;
    for (int p = 0; p < W; p++) {
        soff[p] = stot;
        stot += send_bytes[p];
        roff[p] = rtot;
        rtot += recv_bytes[p];
    }
    if ((st = grow(t, &r->dsend, &r->send_cap, stot)) || (st = grow(t, &r->drecv, &r->recv_cap, rtot))) return st;
    if (stot) CU_TRY(cudaMemcpyAsync(r->dsend, send, (size_t)stot, cudaMemcpyHostToDevice, r->stream), "send upload");
    if ((st = exchange(t, r->dsend, soff, send_bytes, r->drecv, roff, recv_bytes))) return st;
    /* more than recv_cap: the receives still ran (no peer waits), the bytes are not delivered */
    const int over = rtot > recv_cap;
    if (rtot && !over)
        CU_TRY(cudaMemcpyAsync(recv, r->drecv, (size_t)rtot, cudaMemcpyDeviceToHost, r->stream), "receive download");
    CU_TRY(cudaStreamSynchronize(r->stream), "exchange");
    if (over)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "ep nccl: rank %d receives %lld bytes, more than %lld", t->rank,
                                (long long)rtot, (long long)recv_cap);
    return FP4MOE_OK;
}

/* Device memory in and out: the group straight on the caller's buffers, on the rank's NCCL stream
 * (the caller has waited for its writes; this waits for NCCL before returning). */
static int nccl_alltoallv_dev(ep_transport *t, const void *send, const int64_t *send_bytes, void *recv,
                              const int64_t *recv_bytes, const ep_dev_io *io) {
    (void)io;
    nccl_rank *r = t->impl;
    int64_t soff[64], roff[64], so = 0, ro = 0;
    for (int p = 0; p < t->world; p++) {
        soff[p] = so;
        so += send_bytes[p];
        roff[p] = ro;
        ro += recv_bytes[p];
    }
    CU_TRY(cudaSetDevice(r->device), "cudaSetDevice");
    const int st = exchange(t, (const char *)send, soff, send_bytes, (char *)recv, roff, recv_bytes);
    if (st) return st;
    CU_TRY(cudaStreamSynchronize(r->stream), "exchange");
    return FP4MOE_OK;
}

static void rank_free(nccl_rank *r) {
    if (!r) return;
    cudaSetDevice(r->device);
    if (r->stream) cudaStreamSynchronize(r->stream);
    cudaFree(r->dsend);
    cudaFree(r->drecv);
    cudaFree(r->dcnt);
    if (r->stream) cudaStreamDestroy(r->stream);
    if (r->comm) N.comm_destroy(r->comm);
}

int ep_nccl_create(int world, const int *devices, ep_transport **ranks) {
    if (world < 1 || world > 64) return fp4moe_set_error(FP4MOE_EINVAL, "ep nccl: %d ranks (1..64)", world);
    if (!nccl_open()) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "ep nccl: %s", N.why);
    if (!getenv("NCCL_NVLS_ENABLE")) setenv("NCCL_NVLS_ENABLE", "0", 0); /* no NVLink multicast */
    int dev[64], ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) {
        (void)cudaGetLastError();
        ndev = 0;
    }
    for (int r = 0; r < world; r++) {
        dev[r] = devices ? devices[r] : r;
        if (dev[r] < 0 || dev[r] >= ndev)
            return fp4moe_set_error(FP4MOE_EINVAL, "ep nccl: rank %d on CUDA device %d, but %d device%s", r, dev[r],
                                    ndev, ndev == 1 ? " is visible" : "s are visible");
        for (int q = 0; q < r; q++)
            if (dev[q] == dev[r])
                return fp4moe_set_error(FP4MOE_EINVAL, "ep nccl: ranks %d and %d on the same device %d (NCCL "
                                        "needs one device per rank; the loopback group shares one)", q, r, dev[r]);
    }
    ep_transport *t = calloc((size_t)world, sizeof *t);
    nccl_rank *rk = calloc((size_t)world, sizeof *rk);
    nccl_comm_t comms[64];
    if (!t || !rk) {
        free(t);
        free(rk);
        return fp4moe_set_error(FP4MOE_ENOMEM, "ep nccl: %d ranks", world);
    }
    const nccl_result_t nr = N.comm_init_all(comms, world, dev);
    if (nr != 0) {
        free(t);
        free(rk);
        return fp4moe_set_error(FP4MOE_ECUDA, "ep nccl: ncclCommInitAll over %d devices: %s", world,
                                N.error_string(nr));
    }
    int st = FP4MOE_OK;
    for (int r = 0; r < world; r++) {
        rk[r].comm = comms[r];
        rk[r].device = dev[r];
        t[r] = (ep_transport){r, world, nccl_alltoallv, nccl_alltoallv_dev, &rk[r]};
        ranks[r] = &t[r];
        if (!st && (cudaSetDevice(dev[r]) != cudaSuccess ||
                    cudaStreamCreateWithFlags(&rk[r].stream, cudaStreamNonBlocking) != cudaSuccess ||
                    cudaMalloc((void **)&rk[r].dcnt, (size_t)(2 * world) * 8) != cudaSuccess)) {
            (void)cudaGetLastError();
            st = fp4moe_set_error(FP4MOE_ECUDA, "ep nccl: stream or buffer of rank %d on device %d", r, dev[r]);
        }
    }
    if (st) ep_nccl_free(ranks, world);
    return st;
}

void ep_nccl_free(ep_transport **ranks, int world) {
    if (!ranks || world < 1 || !ranks[0]) return;
    nccl_rank *rk = ranks[0]->impl;
    for (int r = 0; r < world; r++) rank_free(&rk[r]);
    free(rk);
    free(ranks[0]);
    for (int r = 0; r < world; r++) ranks[r] = NULL;
}

int ep_nccl_version(void) {
    int v = 0;
    return nccl_open() && N.get_version(&v) == 0 ? v : 0;
}

#else /* no CUDA in this build */

int ep_nccl_create(int world, const int *devices, ep_transport **ranks) {
    (void)world; (void)devices; (void)ranks;
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "ep nccl: this build has no CUDA support");
}
void ep_nccl_free(ep_transport **ranks, int world) { (void)ranks; (void)world; }
int ep_nccl_version(void) { return 0; }

#endif

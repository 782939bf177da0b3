/* The one-shot all-reduce's shared-memory protocol in one call (see native.py).
 *
 * The same steps as collectives/shm_algorithms.py's _one_shot over regions.py's Regions:
 *   publish the wire check's call number when asked (wirecheck.py's _publish, the header's
 *   fields already there) and wake peers asleep on it, begin the piece (every peer done with piece g - 2), publish the signature, copy the input
 *   into this rank's half, publish the step, wake peers asleep on it, wait for every peer's
 *   step, compare their signatures, fold every rank's operand in rank order into the buffer,
 *   publish the piece done and wake peers asleep on that.
 * A wait that is not over after spin ns returns to Python (phase, peer), which waits
 * with the transport's waiter (deadline, dead peers, sleeping on the sockets) and calls again
 * with that phase: the call resumes there.
 *
 * Bitwise equal to the Python path: each element is computed by the same expression, in the
 * same order ((x0 op x1) op x2) ..., one IEEE operation at a time (compiled without
 * -ffast-math and with -ffp-contract=off); integer sums and products wrap through unsigned
 * arithmetic, as torch's do.
 *
 * fold_copy is the two-shot's fold of a rank's slice (shm_algorithms.all_reduce above 2 ranks),
 * the same FOLDS, with the copy of the result to the output in the same pass.
 *
 * A CPython extension module (_oneshot): a METH_FASTCALL call costs ~0.06 us; a ctypes call of
 * one or two arguments cost 1-1.6 us here, a sixth of a 4 KiB all-reduce. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() do { } while (0)
#endif

enum { PHASE_DONE = 1, PHASE_STEP = 2, PHASE_MISMATCH = 3 };
enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3, U8 = 4, I8 = 5 };
enum { SUM = 0, PRODUCT = 1, MIN = 2, MAX = 3 };

typedef struct {
    int64_t rank, world, dtype, op, nbytes, numel;
    int64_t seq, tag, done, sleeping, call;              /* control.py's word indices */
    int64_t on_step, on_done, on_call;                   /* and events */
    int64_t **ctrl;                                      /* [world]: each rank's control block */
    char **half0, **half1;                               /* [world]: each rank's two halves */
    int64_t *fds;                                        /* [world]: socket to each peer (-1: self) */
} plan_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* *word >= target, now or within spin_ns of busy waiting. */
static int reached(int64_t *word, int64_t target, int64_t spin_ns) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 1;
    if (spin_ns <= 0) return 0;
    int64_t end = now_ns() + spin_ns;
    do {
        for (int k = 0; k < 32; k++) {
            RELAX();
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return 1;
        }
    } while (now_ns() < end);
    return 0;
}

/* Write a byte to each peer asleep on event (waiting.py's wake; a full socket is fine). */
static void wake(const plan_t *p, int64_t event) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* our counter before their sleeping words */
    for (int64_t q = 0; q < p->world; q++) {
        if (q != p->rank && (__atomic_load_n(&p->ctrl[q][p->sleeping], __ATOMIC_RELAXED) & event)) {
            char zero = 0;
            (void)send((int)p->fds[q], &zero, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
    }
}

#define BLOCK 1024
/* fold_copy's block: its operands, out and also stay in L1/L2 between the fold and the copy
 * (4-256 KiB measured within 5 % of each other). */
#define FUSED_BLOCK_BYTES 16384

/* x86-64: a 256-bit copy of each fold where the CPU has AVX2, picked at load (the same
 * elementwise operations, so the same bits; 1 MiB float32 sum in cache 25 instead of 34 us). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

/* out[i] = ((x[0][i] OP x[1][i]) OP x[2][i]) ...; out may be one of the x (read before written). */
#define FOLD(NAME, T, EXPR)                                                          \
    WIDE static void NAME(T *out, T *const *x, int64_t n, int64_t count) {           \
        if (n == 2) {                                                                \
            const T *u = x[0], *v = x[1];                                            \
            for (int64_t i = 0; i < count; i++) {                                    \
                T a = u[i], b = v[i];                                                \
                out[i] = (EXPR);                                                     \
            }                                                                        \
            return;                                                                  \
        }                                                                            \
        T acc[BLOCK];                                                                \
        for (int64_t lo = 0; lo < count; lo += BLOCK) {                              \
            int64_t m = count - lo < BLOCK ? count - lo : BLOCK;                     \
            const T *u = x[0] + lo, *v = x[1] + lo;                                  \
            for (int64_t i = 0; i < m; i++) {                                        \
                T a = u[i], b = v[i];                                                \
                acc[i] = (EXPR);                                                     \
            }                                                                        \
            for (int64_t k = 2; k < n; k++) {                                        \
                v = x[k] + lo;                                                       \
                for (int64_t i = 0; i < m; i++) {                                    \
                    T a = acc[i], b = v[i];                                          \
                    acc[i] = (EXPR);                                                 \
                }                                                                    \
            }                                                                        \
            memcpy(out + lo, acc, (size_t)m * sizeof(T));                            \
        }                                                                            \
    }

FOLD(sum_f32, float, a + b)
FOLD(sum_f64, double, a + b)
FOLD(mul_f32, float, a * b)
FOLD(mul_f64, double, a * b)
FOLD(sum_u32, uint32_t, a + b)
FOLD(sum_u64, uint64_t, a + b)
FOLD(sum_u8, uint8_t, (uint8_t)(a + b))
FOLD(mul_u32, uint32_t, a * b)
FOLD(mul_u64, uint64_t, a * b)
FOLD(mul_u8, uint8_t, (uint8_t)((uint32_t)a * b))
FOLD(min_i32, int32_t, b < a ? b : a)
FOLD(max_i32, int32_t, b > a ? b : a)
FOLD(min_i64, int64_t, b < a ? b : a)
FOLD(max_i64, int64_t, b > a ? b : a)
FOLD(min_i8, int8_t, b < a ? b : a)
FOLD(max_i8, int8_t, b > a ? b : a)
FOLD(min_u8, uint8_t, b < a ? b : a)
FOLD(max_u8, uint8_t, b > a ? b : a)

typedef void (*fold_t)(void *, void *const *, int64_t, int64_t);

/* [dtype][op]; NULL: not offered (native.py's table says the same). */
static const fold_t FOLDS[6][4] = {
    [F32] = {(fold_t)sum_f32, (fold_t)mul_f32, NULL, NULL},
    [F64] = {(fold_t)sum_f64, (fold_t)mul_f64, NULL, NULL},
    [I32] = {(fold_t)sum_u32, (fold_t)mul_u32, (fold_t)min_i32, (fold_t)max_i32},
    [I64] = {(fold_t)sum_u64, (fold_t)mul_u64, (fold_t)min_i64, (fold_t)max_i64},
    [U8] = {(fold_t)sum_u8, (fold_t)mul_u8, (fold_t)min_u8, (fold_t)max_u8},
    [I8] = {(fold_t)sum_u8, (fold_t)mul_u8, (fold_t)min_i8, (fold_t)max_i8},
};

static int offers(int64_t dtype, int64_t op) {
    return dtype >= 0 && dtype < 6 && op >= 0 && op < 4 && FOLDS[dtype][op] != NULL;
}

#define MAX_STACK_RANKS 64

/* One-shot all-reduce of buf (p->numel elements) as piece g, step `step`, with `signature`;
 * a wait spins at most `spin` ns; `call` > 0: first publish it as the checked collective's number.
 * Returns 0 when done, else phase << 32 | peer: wait for that peer's DONE (PHASE_DONE) or
 * step (PHASE_STEP) and call again with that phase, or its signature differs (PHASE_MISMATCH). */
static int64_t one_shot(const plan_t *p, char *buf, int64_t g, int64_t step, int64_t signature, int64_t phase,
                       int64_t spin, int64_t call) {
    int64_t n = p->world, r = p->rank;
    char **half = (g & 1) ? p->half1 : p->half0;
    if (phase == 0 && call > 0) {
        __atomic_store_n(&p->ctrl[r][p->call], call, __ATOMIC_RELAXED);
        wake(p, p->on_call);
    }
    if (phase <= PHASE_DONE) {
        if (g >= 2) {
            for (int64_t q = 0; q < n; q++)
                if (q != r && !reached(&p->ctrl[q][p->done], g - 1, spin)) return (int64_t)PHASE_DONE << 32 | q;
        }
        __atomic_store_n(&p->ctrl[r][p->tag + (g & 1)], signature, __ATOMIC_RELAXED);
        memcpy(half[r], buf, (size_t)p->nbytes);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the half and signature before the step */
        __atomic_store_n(&p->ctrl[r][p->seq], step, __ATOMIC_RELAXED);
        wake(p, p->on_step);
    }
    for (int64_t q = 0; q < n; q++)
        if (q != r && !reached(&p->ctrl[q][p->seq], step, spin)) return (int64_t)PHASE_STEP << 32 | q;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* their halves only after their steps */
    for (int64_t q = 0; q < n; q++)
        if (__atomic_load_n(&p->ctrl[q][p->tag + (g & 1)], __ATOMIC_RELAXED) != signature)
            return (int64_t)PHASE_MISMATCH << 32 | q;
    void *operands[MAX_STACK_RANKS];
    for (int64_t q = 0; q < n; q++) operands[q] = q == r ? (void *)buf : (void *)half[q];
    FOLDS[p->dtype][p->op](buf, operands, n, p->numel);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* our reads of their halves before we say so */
    __atomic_store_n(&p->ctrl[r][p->done], g + 1, __ATOMIC_RELAXED);
    wake(p, p->on_done);
    return 0;
}

/* Calls from at least this many bytes let other threads run (the copy and fold take a while). */
#define RELEASE_GIL_BYTES 65536

static const int64_t ITEMSIZE[6] = {[F32] = 4, [F64] = 8, [I32] = 4, [I64] = 8, [U8] = 1, [I8] = 1};

/* The two-shot's reduction of a rank's slice (shm_algorithms.all_reduce): out = the fold of
 * x[0..n-1] in rank order, and also = out, a block at a time while the block is in cache: one
 * pass over memory instead of a fold and then a copy that reads out again. also may be one of
 * the x (each block of it is read before it is written). */
static void fold_copy(fold_t fold, int64_t size, char *out, char *also, char *const *x, int64_t n, int64_t count) {
    const int64_t block = FUSED_BLOCK_BYTES / size;
    void *xs[MAX_STACK_RANKS];
    for (int64_t lo = 0; lo < count; lo += block) {
        int64_t m = count - lo < block ? count - lo : block;
        for (int64_t q = 0; q < n; q++) xs[q] = x[q] + lo * size;
        fold(out + lo * size, xs, n, m);
        if (also != NULL) memcpy(also + lo * size, out + lo * size, (size_t)(m * size));
    }
}

static PyObject *py_fold_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[5 + MAX_STACK_RANKS];
    if (nargs < 7 || nargs > 5 + MAX_STACK_RANKS) {
        PyErr_SetString(PyExc_TypeError, "fold_copy(dtype, op, out, also, count, x0, x1, ...): integers, 2 to 64 operands");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) v[i] = PyLong_AsLongLong(args[i]);
    if (PyErr_Occurred()) return NULL;
    if (!offers(v[0], v[1])) {
        PyErr_SetString(PyExc_ValueError, "fold_copy: (dtype, op) not offered");
        return NULL;
    }
    fold_t fold = FOLDS[v[0]][v[1]];
    int64_t size = ITEMSIZE[v[0]], n = nargs - 5, count = v[4];
    char *x[MAX_STACK_RANKS];
    for (int64_t q = 0; q < n; q++) x[q] = (char *)(intptr_t)v[5 + q];
    char *out = (char *)(intptr_t)v[2], *also = (char *)(intptr_t)v[3];
    if (count * size >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        fold_copy(fold, size, out, also, x, n, count);
        Py_END_ALLOW_THREADS
    } else {
        fold_copy(fold, size, out, also, x, n, count);
    }
    Py_RETURN_NONE;
}

static PyObject *py_one_shot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[8];
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "one_shot(plan, buf, g, step, signature, phase, spin, call): 8 integers");
        return NULL;
    }
    for (int i = 0; i < 8; i++) v[i] = PyLong_AsLongLong(args[i]);
    if (PyErr_Occurred()) return NULL;
    const plan_t *p = (const plan_t *)(intptr_t)v[0];
    int64_t reply;
    if (p->nbytes >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        reply = one_shot(p, (char *)(intptr_t)v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
        Py_END_ALLOW_THREADS
    } else {
        reply = one_shot(p, (char *)(intptr_t)v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    }
    return PyLong_FromLongLong(reply);
}

static PyObject *py_offers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "offers(dtype, op): 2 integers");
        return NULL;
    }
    int64_t dtype = PyLong_AsLongLong(args[0]), op = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(offers(dtype, op));
}

static PyMethodDef methods[] = {
    {"one_shot", (PyCFunction)(void (*)(void))py_one_shot, METH_FASTCALL,
     "one_shot(plan, buf, g, step, signature, phase, spin, call) -> 0, or phase << 32 | peer"},
    {"fold_copy", (PyCFunction)(void (*)(void))py_fold_copy, METH_FASTCALL,
     "fold_copy(dtype, op, out, also, count, x0, x1, ...): out = fold of the x in rank order, also = out (also 0: none)"},
    {"offers", (PyCFunction)(void (*)(void))py_offers, METH_FASTCALL, "offers(dtype, op) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_oneshot", "ringddp's native one-shot all-reduce",
                                    -1, methods};

PyMODINIT_FUNC PyInit__oneshot(void) { return PyModule_Create(&module); }

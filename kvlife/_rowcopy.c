/* Row copies for the CPU copy paths: many scattered rows of a KV cache to and from host
 * pages in one call, without the GIL, split over a few threads, with streaming
 * (non-temporal) stores on x86.
 *
 * Why: a job of hundreds of MiB moves rows of tens of KiB at scattered places. Ordinary
 * stores read each destination line into the cache before writing it, and a row that
 * short never reaches the size at which memcpy itself switches to streaming stores, so a
 * scattered copy ran at 0.6x to 0.9x a contiguous copy of the same bytes. Streaming
 * stores write around the cache (the rows are not read again soon: a host page waits
 * for a load, a loaded block for the next step). docs/engines.md has the figures.
 *
 * copy_rows(dst, src, row_bytes, threads): dst and src are buffers of uint64 addresses,
 * entry i copies row_bytes[i % len(row_bytes)] bytes from src[i] to dst[i]. The caller
 * (kvlife.layout) computes the addresses from tensors it has checked and keeps alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 16

typedef struct {
    const uint64_t *dst;
    const uint64_t *src;
    const uint64_t *sizes;
    Py_ssize_t first, last, width;
} Part;

static void copy_row(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static void *copy_part(void *arg)
{
    const Part *p = arg;
    for (Py_ssize_t i = p->first; i < p->last; i++)
        copy_row((char *)(uintptr_t)p->dst[i], (const char *)(uintptr_t)p->src[i],
                 (size_t)p->sizes[i % p->width]);
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed lines are visible before the thread is joined */
#endif
    return NULL;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    Py_buffer dst, src, sizes;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &dst, &src, &sizes, &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = dst.len / 8, width = sizes.len / 8;
    if (dst.len % 8 || sizes.len % 8 || src.len != dst.len || width == 0 || n % width) {
        PyErr_SetString(PyExc_ValueError,
                        "dst and src must be equal uint64 address buffers, a whole number of "
                        "rows of len(row_bytes) entries");
        goto done;
    }
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > n)
        threads = n > 0 ? (int)n : 1;
    Part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++)
        parts[t] = (Part){dst.buf, src.buf, sizes.buf, n * t / threads, n * (t + 1) / threads,
                          width};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, copy_part, &parts[t]) == 0;
    copy_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            copy_part(&parts[t]); /* no thread to be had: this one copies it */
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, src, row_bytes, threads): copy row i of row_bytes[i % len(row_bytes)] "
     "bytes from address src[i] to dst[i] (uint64 buffers), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }

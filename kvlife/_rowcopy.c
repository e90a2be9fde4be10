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
 * copy_rows(dst, src, row_bytes, threads, stream=1, team=0): dst and src are buffers of
 * uint64 addresses, entry i copies row_bytes[i % len(row_bytes)] bytes from src[i] to
 * dst[i], on up to `threads` threads, the calling one among them (see Job: it never waits
 * for a thread that has not started); stream=0 copies by memcpy (for copies that fit the
 * last-level cache); team=1 copies on torch's OpenMP team (use_openmp) where it was
 * found, and it returns whether it did. The caller (kvlife.layout) computes the addresses
 * from tensors it has checked and keeps alive.
 *
 * use_openmp(path): find the OpenMP runtime torch loaded (its library's path, already
 * loaded: nothing is loaded here), for copy_rows(team=1) from the thread whose team runs
 * torch's own work (the main thread). That team stays awake between torch's ops (its
 * threads spin a while), so a helper thread of ours had to wait for a core that one of
 * them held, and arrived late on a small machine; the team's threads are already
 * running. True if its GOMP_parallel was found; in a forked child the module's own
 * threads are used again (an OpenMP runtime may not run a team there). Other threads
 * keep this module's threads: a team made for them would spin beside torch's.
 *
 * copy_pages(load, pages, num_pages, runs, (host_rows, host_base, host_stride), geometry,
 * threads, stream, team, error): a layout's copy of `pages` (1-D int64, each in
 * [0, num_pages)) to or from host rows given as int64 runs (offset, first row, length),
 * every page once and every row in [0, host_rows), with the addresses made here: each
 * buffer b is geometry[b] = (address, row stride, its offset in a host row, row bytes), a
 * host row `row` is at host_base + row * host_stride. A page or run that breaks a rule
 * raises `error` and copies nothing; else as copy_rows.
 *
 * claim(writes, written, reads, read, n): a copy's marks on the page-use counts of
 * kvlife.engine.base (int32 buffers; -1: a copy writes the page, k > 0: k copies read it):
 * the pages it writes (int64 indices `written` into `writes`) and those it reads. n = 1
 * marks them (written -1, read one reader more) only if every page it writes is untouched
 * and none it reads is being written; n = 0 only checks that; n = -1 unmarks. Returns
 * whether the pages were free (always true for n = -1).
 *
 * pages(seq, limit): the engines' check of a chunk's page list in one pass: every item
 * an exact int (or an int32 or int64 array's item) in [0, limit), none twice. Returns the pages as a bytearray of int64, or
 * the position of the first item that fails (the caller names the error).
 *
 * runs(pages): the maximal runs of consecutive pages (read as pages() reads them) as a
 * list of (offset, first page, length): a chunk's host rows, most often one run; None
 * where an item is not an exact int (the caller walks them in Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 16
/* The rows a thread takes at a time: about this many bytes. */
#define BATCH_BYTES (64 << 10)

/* One call's rows, taken by its threads a batch at a time from `next`. The call waits only
 * for the batches a thread has taken (`busy` counts the threads between taking and
 * finishing), never for a thread that has not started: on a machine whose cores are taken
 * (another pool's threads spinning, a busy host) the calling thread copies the rows no
 * helper reached and returns, and a helper that starts later finds nothing left and
 * exits. So the job is on the heap, freed by whichever of its threads leaves last
 * (`refs`); a thread that took no rows touches nothing else. */
typedef struct {
    int stream;
    const uint64_t *dst;
    const uint64_t *src;
    const uint64_t *sizes;
    Py_ssize_t rows, width, batch;
    atomic_size_t next;
    atomic_int busy;
    atomic_int refs;
} Job;

static void leave(Job *job)
{
    if (atomic_fetch_sub(&job->refs, 1) == 1)
        free(job);
}

static void copy_row(char *dst, const char *src, size_t n, int stream)
{
#if defined(__SSE2__)
    if (!stream) {
        memcpy(dst, src, n);
        return;
    }
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
    (void)stream;
    memcpy(dst, src, n);
#endif
}

/* Rows this far ahead are prefetched, a line in each 4 KiB page of them: the page walks
 * and the first misses of scattered rows overlap the copy of the rows before, instead of
 * stalling it (a scattered copy of 16 KiB rows on one thread goes from 0.6x-0.9x a
 * contiguous memcpy to 1.0x-1.1x). Targets are prefetched for writing, except streamed. */
#define AHEAD 2
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address, write) __builtin_prefetch((address), (write), 3)
#else
#define PREFETCH(address, write) ((void)(address))
#endif

static void prefetch_row(const char *src, char *dst, size_t n, int stream)
{
    for (size_t o = 0; o < n; o += 4096) {
        PREFETCH(src + o, 0);
        if (!stream)
            PREFETCH(dst + o, 1);
    }
    if (n) {
        PREFETCH(src + n - 1, 0);
        if (!stream)
            PREFETCH(dst + n - 1, 1);
    }
}

static void copy_part(Job *job)
{
    const uint64_t *dst = job->dst, *src = job->src, *sizes = job->sizes;
    Py_ssize_t rows = job->rows, width = job->width;
    for (;;) {
        Py_ssize_t first = (Py_ssize_t)atomic_fetch_add(&job->next, (size_t)job->batch);
        if (first >= rows)
            break;
        Py_ssize_t last = first + job->batch < rows ? first + job->batch : rows;
        for (Py_ssize_t i = first; i < last; i++) {
            Py_ssize_t j = i + AHEAD; /* the next batch's first rows too: most often this
                                          thread's, and a prefetch is never wrong */
            if (j < rows)
                prefetch_row((const char *)(uintptr_t)src[j], (char *)(uintptr_t)dst[j],
                             (size_t)sizes[j % width], job->stream);
            copy_row((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i],
                     (size_t)sizes[i % width], job->stream);
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed lines are visible before the call returns */
#endif
}

static void *helper(void *arg)
{
    Job *job = arg;
    atomic_fetch_add(&job->busy, 1); /* before it takes a batch: see Job */
    copy_part(job);
    atomic_fetch_sub(&job->busy, 1);
    leave(job);
    return NULL;
}

/* The OpenMP runtime's entry that runs fn(data) on a team of num_threads (the caller one
 * of them) and returns when all are done: libgomp's ABI, also exported by LLVM's libomp
 * and Intel's libiomp5. NULL: this module's own threads. */
typedef void (*GompParallel)(void (*fn)(void *), void *data, unsigned num_threads,
                             unsigned flags);
static GompParallel gomp_parallel = NULL;
static pid_t gomp_pid = 0; /* the process that found it (not a forked child) */

static void team_part(void *job) { copy_part(job); }

static PyObject *use_openmp(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* only if already loaded */
    void *entry = library ? dlsym(library, "GOMP_parallel") : NULL;
    if (entry == NULL) {
        if (library)
            dlclose(library);
        Py_RETURN_FALSE;
    }
    gomp_parallel = (GompParallel)entry; /* the handle stays open: the library stays */
    gomp_pid = getpid();
    Py_RETURN_TRUE;
}

/* The job on `threads` threads of this module's own, the calling one among them. */
static void copy_on_own_threads(Job *job, int threads)
{
    pthread_attr_t attr;
    int detached = pthread_attr_init(&attr) == 0;
    if (detached && pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) != 0) {
        pthread_attr_destroy(&attr);
        detached = 0;
    }
    for (int t = 1; t < threads && detached; t++) {
        pthread_t id;
        atomic_fetch_add(&job->refs, 1);
        if (pthread_create(&id, &attr, helper, job) != 0)
            atomic_fetch_sub(&job->refs, 1);
    }
    if (detached)
        pthread_attr_destroy(&attr);
    copy_part(job); /* this thread copies too: all of it where no helper starts */
    /* Every batch is taken; wait for those a helper is still copying (short: at most a
     * batch each, unless its core was taken from it mid-batch). */
    for (int spins = 0; atomic_load(&job->busy); spins++) {
        if (spins < 64)
            sched_yield();
        else
            nanosleep(&(struct timespec){0, 20000}, NULL);
    }
}

/* The rows dst[i] <- src[i] of sizes[i % width] bytes on up to `threads` threads (see the
 * header); whether they ran on torch's team, or -1 (no memory, an exception set). */
static int run_rows(const uint64_t *dst, const uint64_t *src, const uint64_t *sizes,
                    Py_ssize_t n, Py_ssize_t width, int threads, int stream, int team)
{
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    uint64_t row_bytes = 0;
    for (Py_ssize_t c = 0; c < width; c++)
        row_bytes += sizes[c];
    row_bytes = row_bytes / (uint64_t)width + 1;
    Job *job = malloc(sizeof(Job));
    if (job == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *job = (Job){.stream = stream, .dst = dst, .src = src, .sizes = sizes, .rows = n,
                 .width = width, .batch = (Py_ssize_t)(BATCH_BYTES / row_bytes) + 1};
    atomic_init(&job->next, 0);
    atomic_init(&job->busy, 0);
    atomic_init(&job->refs, 1);
    if (threads > (n + job->batch - 1) / job->batch)
        threads = (int)((n + job->batch - 1) / job->batch);
    team = team && threads > 1 && gomp_parallel != NULL && getpid() == gomp_pid;
    Py_BEGIN_ALLOW_THREADS
    if (team)
        gomp_parallel(team_part, job, (unsigned)threads, 0);
    else
        copy_on_own_threads(job, threads);
    leave(job);
    Py_END_ALLOW_THREADS
    return team;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    Py_buffer dst, src, sizes;
    int threads, stream = 1, team = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*i|pp", &dst, &src, &sizes, &threads, &stream, &team))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = dst.len / 8, width = sizes.len / 8;
    if (dst.len % 8 || sizes.len % 8 || src.len != dst.len || width == 0 || n % width) {
        PyErr_SetString(PyExc_ValueError,
                        "dst and src must be equal uint64 address buffers, a whole number of "
                        "rows of len(row_bytes) entries");
        goto done;
    }
    team = run_rows(dst.buf, src.buf, sizes.buf, n, width, threads, stream, team);
    if (team >= 0)
        result = PyBool_FromLong(team);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return result;
}

/* A strided buffer with its format, for "O&" (released by Python on a later failure). */
static int strided_buffer(PyObject *obj, void *out)
{
    if (obj == NULL) {
        PyBuffer_Release(out);
        return 1;
    }
    return PyObject_GetBuffer(obj, out, PyBUF_RECORDS_RO) == 0 ? Py_CLEANUP_SUPPORTED : 0;
}

/* The signed integer width (4 or 8) of a 1-D buffer of int32 or int64, or 0. */
static int int_width(const Py_buffer *view)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (view->ndim != 1 || f[1] != '\0')
        return 0;
    if (view->itemsize == 4 && f[0] == 'i')
        return 4;
    return view->itemsize == 8 && (f[0] == 'q' || f[0] == 'l') ? 8 : 0;
}

/* copy_pages: see the header. Each page is read once, checked, and only its checked value
 * makes an address, so no other thread can change a page between its check and its copy. */
static PyObject *copy_pages(PyObject *self, PyObject *args)
{
    PyObject *error, *result = NULL;
    Py_buffer pages, runs, geometry;
    int load, stream, team, threads;
    long long num_pages, host_rows, host_base, host_stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "pO&LO&(LLL)y*ippO", &load, strided_buffer, &pages, &num_pages,
                          strided_buffer, &runs, &host_rows, &host_base, &host_stride, &geometry,
                          &threads, &stream, &team, &error))
        return NULL;
    int64_t *rows = NULL;
    uint64_t *addresses = NULL, *sizes = NULL;
    const int64_t *run = runs.buf, *geo = geometry.buf;
    Py_ssize_t width = geometry.len / 32, count = runs.len / 24, n = 0, step = 8;
    if (int_width(&pages) != 8) {
        PyErr_Format(error, "pages must be 1-D int64, got format %s of %d dimensions",
                     pages.format == NULL ? "B" : pages.format, pages.ndim);
        goto done;
    }
    n = pages.shape[0];
    step = pages.strides[0];
    if (runs.itemsize != 8 || (runs.len && (runs.ndim != 2 || runs.shape[1] != 3)) ||
        (runs.ndim == 2 && runs.strides[0] != 24) || geometry.len % 32 || width == 0) {
        PyErr_Format(error, "host runs must be int64 (offset, row, length) triples");
        goto done;
    }
    rows = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    addresses = malloc((size_t)(2 * n * width + width) * sizeof(uint64_t));
    if (rows == NULL || addresses == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        rows[i] = -1;
    for (Py_ssize_t r = 0; r < count; r++) {
        int64_t offset = run[3 * r], row = run[3 * r + 1], length = run[3 * r + 2];
        if (offset < 0 || length < 0 || offset > n - length || row < 0 || row > host_rows - length) {
            PyErr_Format(error, "host run (%lld, %lld, %lld) outside %zd pages or %lld rows",
                         (long long)offset, (long long)row, (long long)length, n, host_rows);
            goto done;
        }
        for (int64_t i = 0; i < length; i++) {
            if (rows[offset + i] >= 0) {
                PyErr_Format(error, "host runs name page %lld twice", (long long)(offset + i));
                goto done;
            }
            rows[offset + i] = row + i;
        }
    }
    uint64_t *on_device = addresses, *on_host = addresses + n * width;
    sizes = on_host + n * width;
    for (Py_ssize_t b = 0; b < width; b++)
        sizes[b] = (uint64_t)geo[4 * b + 3];
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t page = *(const int64_t *)((const char *)pages.buf + i * step);
        if (page < 0 || page >= num_pages || rows[i] < 0) {
            if (rows[i] < 0)
                PyErr_Format(error, "host runs leave page %zd of %zd without a row", i, n);
            else
                PyErr_Format(error, "page %lld out of range [0, %lld)", (long long)page,
                             num_pages);
            goto done;
        }
        for (Py_ssize_t b = 0; b < width; b++) {
            on_device[i * width + b] = (uint64_t)(geo[4 * b] + page * geo[4 * b + 1]);
            on_host[i * width + b] = (uint64_t)(host_base + rows[i] * host_stride + geo[4 * b + 2]);
        }
    }
    team = run_rows(load ? on_device : on_host, load ? on_host : on_device, sizes, n * width,
                    width, threads, stream, team);
    if (team >= 0)
        result = PyBool_FromLong(team);
done:
    free(rows);
    free(addresses);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&runs);
    PyBuffer_Release(&geometry);
    return result;
}

/* A page list as pages() and runs() read it: an int32 or int64 array as it is (any
 * stride), any other sequence item by item. */
typedef struct {
    Py_buffer view;
    PyObject *fast;
    int width;
    Py_ssize_t n;
} PageList;

static int open_pages(PyObject *seq, PageList *list)
{
    *list = (PageList){.fast = NULL};
    if (PyObject_CheckBuffer(seq) && PyObject_GetBuffer(seq, &list->view, PyBUF_RECORDS_RO) == 0) {
        list->width = int_width(&list->view);
        if (!list->width)
            PyBuffer_Release(&list->view);
    }
    PyErr_Clear();
    if (list->width) {
        list->n = list->view.shape[0];
        return 0;
    }
    if ((list->fast = PySequence_Fast(seq, "pages must be a sequence")) == NULL)
        return -1;
    list->n = PySequence_Fast_GET_SIZE(list->fast);
    return 0;
}

/* Page i of the list into *v; 0 where it is not an exact int within int64. */
static int page_at(const PageList *list, Py_ssize_t i, long long *v)
{
    if (list->width) {
        const char *at = (const char *)list->view.buf + i * list->view.strides[0];
        *v = list->width == 4 ? *(const int32_t *)at : *(const int64_t *)at;
        return 1;
    }
    PyObject *item = PySequence_Fast_ITEMS(list->fast)[i];
    int overflow = 0;
    if (!PyLong_CheckExact(item))
        return 0;
    *v = PyLong_AsLongLongAndOverflow(item, &overflow);
    return !overflow;
}

static void close_pages(PageList *list)
{
    if (list->width)
        PyBuffer_Release(&list->view);
    Py_XDECREF(list->fast);
}

/* pages(seq, limit): see the header. Duplicates are found in an open-addressing table of
 * at least twice the pages, so the cost does not depend on limit. */
static PyObject *pages(PyObject *self, PyObject *args)
{
    PyObject *seq;
    long long limit;
    PageList list;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL", &seq, &limit) || open_pages(seq, &list) < 0)
        return NULL;
    Py_ssize_t n = list.n, size = 16, bad = -1;
    while (size < 2 * n)
        size *= 2;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    uint64_t *table = PyMem_Calloc((size_t)size, sizeof(uint64_t)); /* page + 1; 0: empty */
    int64_t *values = out == NULL ? NULL : (int64_t *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n && bad < 0 && values != NULL && table != NULL; i++) {
        long long v = -1;
        if (!page_at(&list, i, &v) || v < 0 || v >= limit) {
            bad = i;
            break;
        }
        values[i] = v;
        uint64_t key = (uint64_t)v + 1;
        size_t slot = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (size_t)(size - 1);
        while (table[slot] && table[slot] != key)
            slot = (slot + 1) & (size_t)(size - 1);
        if (table[slot])
            bad = i; /* a page named twice */
        table[slot] = key;
    }
    PyMem_Free(table);
    close_pages(&list);
    if (out == NULL || table == NULL) {
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    if (bad >= 0) {
        Py_DECREF(out);
        return PyLong_FromSsize_t(bad);
    }
    return out;
}

/* claim(writes, written, reads, read, n): see the header. */
static PyObject *claim(PyObject *self, PyObject *args)
{
    Py_buffer wu, w, ru, r;
    int n;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*w*y*i", &wu, &w, &ru, &r, &n))
        return NULL;
    int32_t *writes = wu.buf, *reads = ru.buf;
    const int64_t *wi = w.buf, *ri = r.buf;
    Py_ssize_t nw = w.len / 8, nr = r.len / 8, lw = wu.len / 4, lr = ru.len / 4;
    PyObject *result = NULL;
    int free_to_claim = 1;
    for (Py_ssize_t i = 0; i < nw; i++)
        if (wi[i] < 0 || wi[i] >= lw)
            goto out_of_range;
    for (Py_ssize_t i = 0; i < nr; i++)
        if (ri[i] < 0 || ri[i] >= lr)
            goto out_of_range;
    if (n >= 0) {
        for (Py_ssize_t i = 0; i < nw && free_to_claim; i++)
            free_to_claim = writes[wi[i]] == 0;
        for (Py_ssize_t i = 0; i < nr && free_to_claim; i++)
            free_to_claim = reads[ri[i]] >= 0;
    }
    if (free_to_claim && n) {
        for (Py_ssize_t i = 0; i < nw; i++)
            writes[wi[i]] = n > 0 ? -1 : 0;
        for (Py_ssize_t i = 0; i < nr; i++)
            reads[ri[i]] += n;
    }
    result = PyBool_FromLong(free_to_claim);
    goto done;
out_of_range:
    PyErr_SetString(PyExc_ValueError, "a page index outside its use counts");
done:
    PyBuffer_Release(&wu);
    PyBuffer_Release(&w);
    PyBuffer_Release(&ru);
    PyBuffer_Release(&r);
    return result;
}

/* runs(pages): see the header. */
static PyObject *runs(PyObject *self, PyObject *arg)
{
    PageList list;
    (void)self;
    if (open_pages(arg, &list) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    long long first = 0, last = 0, v = 0;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; out != NULL && i <= list.n; i++) {
        if (i < list.n && !page_at(&list, i, &v)) { /* not an int: the caller walks them */
            Py_DECREF(out);
            out = Py_NewRef(Py_None);
            break;
        }
        if (i > 0 && i < list.n && last < LLONG_MAX && v == last + 1) {
            last = v;
            continue;
        }
        if (i > 0) {
            PyObject *run = Py_BuildValue("(nLn)", start, first, i - start);
            if (run == NULL || PyList_Append(out, run) < 0)
                Py_CLEAR(out);
            Py_XDECREF(run);
        }
        start = i;
        first = last = v;
    }
    close_pages(&list);
    return out;
}

static PyMethodDef methods[] = {
    {"claim", claim, METH_VARARGS,
     "claim(writes, written, reads, read, n): a chunk's page-use counts (int32) at its int64 "
     "indices; n=1 claims, n=0 checks, n=-1 releases. Whether the pages were free to claim."},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, src, row_bytes, threads, stream=1, team=0): copy row i of "
     "row_bytes[i % len(row_bytes)] bytes from address src[i] to dst[i] (uint64 buffers), "
     "without the GIL; stream=0: by memcpy, no streaming stores; team=1: on torch's OpenMP "
     "team where use_openmp found it. Returns whether it did."},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(load, pages, num_pages, runs, (host_rows, host_base, host_stride), geometry, "
     "threads, stream, team, error): a layout's pages to or from host rows, checked and "
     "addressed here, copied as copy_rows; error: the exception type of a refusal."},
    {"use_openmp", use_openmp, METH_O,
     "use_openmp(path): copy on the team of the OpenMP runtime loaded from path (already "
     "loaded by torch); True if its GOMP_parallel was found."},
    {"pages", pages, METH_VARARGS,
     "pages(seq, limit): seq's exact ints (or an int32 or int64 array's), each in [0, limit) "
     "and none twice, as a bytearray of int64; else the position of the first that is not."},
    {"runs", runs, METH_O,
     "runs(pages): the maximal runs of consecutive pages as (offset, first, length) "
     "tuples; None where an item is not an exact int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }

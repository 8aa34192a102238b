/* kvtier's host-side batch paths in C: key ids, the compact key table, the slot lists and the
   page states of kvtier.index.

   Built at first use by kvtier.index.native (the system C compiler, Python's headers) and kept
   on disk; every function here has a Python twin that gives the same results, and the tests
   (tests/test_index_native.py) run both on the same inputs. The types own no index state: each
   wraps the arrays of one Python object and changes them exactly as its Python code would, so
   the two paths may be mixed on one object.

   known(...), fill(...): the key-id cache's look-up and batch fill (kvtier.index.keys.key_ids,
   _fill_new). A key's id is BLAKE2b (RFC 7693) with a 16-byte digest and the key's type in the
   personalization, "kvtier-key-bytes" for bytes and "kvtier-key-str" for str (its UTF-8 bytes,
   surrogates passed), as kvtier.index.keys.key_id; keys of one block hash four at a time in
   vector lanes (AVX2 where the CPU has it).

   set_where(...): kvtier.pool.landing's marks and clears of one number a device slot.

   Table(buckets, ids, bucket_of, home, mask): the probes of a KeyTable with Python's hash of each
   16-byte id (the same SipHash the Python code uses, cached in the bytes object).

   Links(next, prev, member, stamp): the links of a SlotList, appended and unlinked one slot
   after the other as its one-at-a-time paths do.

   Links(...) also moves listed slots to the end (LRUPolicy.touch_many).

   States(state, pins, busy, hits, legal, evictable): a TierIndex's state changes, holds, copy
   ends, unpins, reuse, touches and idle slots, and two calls across tables: a pool commit's
   whole bookkeeping (`commit`: the device tier's arrays and key table, the host tier's key
   table and states) and `hold_keyed` (TierIndex.hold_readable); it keeps only a scratch array
   to find repeated slots.

   Lookups go a group of ids at a time, each id's home bucket and slot id fetched ahead, so that
   the cache misses of a table of millions of slots overlap. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtier's host index assumes a little-endian machine"
#endif

#define ID_BYTES 16
#define EMPTY (-1)

/* ---- BLAKE2b, 16-byte digest, no key, with personalization ---- */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

/* A right rotation of 64-bit words: of one word, or of each lane of a vector of them. */
#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))

/* The mixing step, on words or on vectors of four lanes alike. */
#define G(a, b, c, d, x, y)          \
    do {                             \
        a = a + b + (x);             \
        d = ROTR(d ^ a, 32);         \
        c = c + d;                   \
        b = ROTR(b ^ c, 24);         \
        a = a + b + (y);             \
        d = ROTR(d ^ a, 16);         \
        c = c + d;                   \
        b = ROTR(b ^ c, 63);         \
    } while (0)

/* The twelve rounds over `v` and `m` with the step `g` (on words or on four lanes), every
   round spelled out so the schedule's indices are constants and `m` stays in registers. */
#define ROUND(g, r)                                                    \
    do {                                                               \
        g(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]);    \
        g(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]);    \
        g(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]);   \
        g(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]);   \
        g(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]);   \
        g(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]); \
        g(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]);  \
        g(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);  \
    } while (0)
#define ROUNDS(g)                                                          \
    do {                                                                   \
        ROUND(g, 0); ROUND(g, 1); ROUND(g, 2); ROUND(g, 3); ROUND(g, 4);   \
        ROUND(g, 5); ROUND(g, 6); ROUND(g, 7); ROUND(g, 8); ROUND(g, 9);   \
        ROUND(g, 10); ROUND(g, 11);                                        \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t m[16], v[16];
    memcpy(m, block, 128);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= counter;
    if (last) v[14] = ~v[14];
    ROUNDS(G);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The state after the parameter block: digest length 16, no key, fanout 1, depth 1, `person`
   (zero padded to 16 bytes) in words 6 and 7. */
static void start_state(uint64_t h[8], const char *person) {
    uint8_t p[16] = {0};
    memcpy(p, person, strlen(person));
    for (int i = 0; i < 8; i++) h[i] = IV[i];
    h[0] ^= 0x01010000ULL ^ ID_BYTES;
    uint64_t w;
    memcpy(&w, p, 8);
    h[6] ^= w;
    memcpy(&w, p + 8, 8);
    h[7] ^= w;
}

static uint64_t BYTES_STATE[8], STR_STATE[8];

/* The 16-byte id of `len` (> 0) bytes at `data`, from one of the two start states. */
static void digest(const uint64_t start[8], const uint8_t *data, size_t len, uint8_t out[ID_BYTES]) {
    uint64_t h[8];
    memcpy(h, start, sizeof h);
    uint64_t done = 0;
    while (len - done > 128) {
        done += 128;
        compress(h, data + done - 128, done, 0);
    }
    uint8_t last[128] = {0};
    memcpy(last, data + done, len - done);
    compress(h, last, (uint64_t)len, 1);
    memcpy(out, h, ID_BYTES);
}

/* Four single-block messages at once (each at most 128 bytes: one compression with the last
   flag), one in each 64-bit lane of a 4-word vector: the same rounds on four lanes. Built twice,
   for any x86-64 (SSE2, two halves a vector) and for AVX2 (one register a vector), the AVX2 one
   chosen when the CPU has it; elsewhere the compiler's own vectors. */
typedef uint64_t lanes4 __attribute__((vector_size(32)));

/* ids[k] (16 bytes) of message k: `len[k]` (1 to 128) bytes at `data[k]`, from start state `start[k]`. */
static inline __attribute__((always_inline)) void digest4_body(const uint64_t *const start[4], const uint8_t *const data[4],
                                                               const size_t len[4], uint8_t *const ids[4]) {
    uint64_t words[4][16];
    memset(words, 0, sizeof words);
    for (int k = 0; k < 4; k++) memcpy(words[k], data[k], len[k]);
    lanes4 m[16], v[16], h[8];
    for (int j = 0; j < 16; j++) m[j] = (lanes4){words[0][j], words[1][j], words[2][j], words[3][j]};
    for (int i = 0; i < 8; i++) {
        h[i] = (lanes4){start[0][i], start[1][i], start[2][i], start[3][i]};
        v[i] = h[i];
        v[i + 8] = (lanes4){IV[i], IV[i], IV[i], IV[i]};
    }
    v[12] ^= (lanes4){len[0], len[1], len[2], len[3]};
    v[14] = ~v[14];
    ROUNDS(G);
    lanes4 w0 = h[0] ^ v[0] ^ v[8], w1 = h[1] ^ v[1] ^ v[9];
    for (int k = 0; k < 4; k++) {
        uint64_t out[2] = {w0[k], w1[k]};
        memcpy(ids[k], out, ID_BYTES);
    }
}

static void digest4_base(const uint64_t *const start[4], const uint8_t *const data[4], const size_t len[4],
                         uint8_t *const ids[4]) {
    digest4_body(start, data, len, ids);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static void digest4_avx2(const uint64_t *const start[4], const uint8_t *const data[4],
                                                         const size_t len[4], uint8_t *const ids[4]) {
    digest4_body(start, data, len, ids);
}
#endif

typedef void (*digest4_fn)(const uint64_t *const[4], const uint8_t *const[4], const size_t[4], uint8_t *const[4]);
static digest4_fn digest4 = digest4_base; /* set once at import */

/* Whether this CPU runs the AVX2 digests. */
static int has_avx2(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static void choose_digest4(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (has_avx2()) digest4 = digest4_avx2;
#endif
}

/* lanes(avx2) -> bool: the four-lane digests of `fill` run on AVX2 (when the CPU has it) or on
   the build for any CPU; whether AVX2 runs now. For the tests, which run both. */
static PyObject *lanes(PyObject *self, PyObject *arg) {
    (void)self;
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
    digest4 = digest4_base;
    if (want) choose_digest4();
    return PyBool_FromLong(digest4 != digest4_base);
}

/* The id of a plain non-empty key (a new reference), or NULL with an error set. */
static PyObject *id_of_key(PyObject *key) {
    uint8_t id[ID_BYTES];
    if (PyBytes_CheckExact(key)) {
        digest(BYTES_STATE, (const uint8_t *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), id);
    } else if (PyUnicode_IS_ASCII(key)) {
        digest(STR_STATE, (const uint8_t *)PyUnicode_DATA(key), (size_t)PyUnicode_GET_LENGTH(key), id);
    } else {
        PyObject *utf8 = PyUnicode_AsEncodedString(key, "utf-8", "surrogatepass");
        if (!utf8) return NULL;
        digest(STR_STATE, (const uint8_t *)PyBytes_AS_STRING(utf8), (size_t)PyBytes_GET_SIZE(utf8), id);
        Py_DECREF(utf8);
    }
    return PyBytes_FromStringAndSize((const char *)id, ID_BYTES);
}

/* known(keys, young) -> None | (ids, missing): kvtier.index.keys.key_ids' first look at a batch:
   each key's id from the dict `young`, or None where it has none, and how many it lacks; None
   when a key is not a non-empty plain str or bytes (the Python path names it). */
static PyObject *known(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *keys, *young;
    if (!PyArg_ParseTuple(args, "OO!", &keys, &PyDict_Type, &young)) return NULL;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        Py_ssize_t len;
        if (PyBytes_CheckExact(key)) len = PyBytes_GET_SIZE(key);
        else if (PyUnicode_CheckExact(key)) len = PyUnicode_GET_LENGTH(key);
        else Py_RETURN_NONE;
        if (len == 0) Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    Py_ssize_t missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *kid = PyDict_GetItemWithError(young, items[i]);
        if (!kid) {
            if (PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            kid = Py_None;
            missing++;
        }
        Py_INCREF(kid);
        PyList_SET_ITEM(out, i, kid);
    }
    return Py_BuildValue("(Nn)", out, missing);
}

/* fill(keys, out, young, old, max_key, room, chars_room) -> int | None: kvtier.index.keys'
   _fill_new. For each position of `out` (a list as long as `keys`) that holds None: the key's
   id hashed (a key of one block: four at a time, in about the time a lookup in the dict `old`
   would take, so `old` is not asked), or from `old`, else hashed (a longer key); every one of
   them cached in the dict `young` and written to `out` (the same ids and the same young
   generation as the Python fill). Returns how many characters (or bytes) the new keys hold; None, with nothing
   changed, when a key is not a non-empty plain str or bytes, one is longer than `max_key`, they
   are `room` keys or more, or hold `chars_room` characters or more (the cache turns over: the
   Python loop does that). */
static PyObject *fill(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *keys, *out, *young, *old;
    Py_ssize_t max_key, room, chars_room;
    if (!PyArg_ParseTuple(args, "OO!O!O!nnn", &keys, &PyList_Type, &out, &PyDict_Type, &young, &PyDict_Type, &old,
                          &max_key, &room, &chars_room))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a list or tuple");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (PyList_GET_SIZE(out) != n) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "out holds %zd ids for %zd keys", PyList_GET_SIZE(out), n);
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject **kids = NULL; /* the new keys' ids, by position */
    Py_ssize_t *pending = NULL; /* positions of the keys hashed four at a time */
    Py_ssize_t count = 0, chars = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(out, i) != Py_None) continue;
        PyObject *key = items[i];
        Py_ssize_t len;
        if (PyBytes_CheckExact(key)) len = PyBytes_GET_SIZE(key);
        else if (PyUnicode_CheckExact(key)) len = PyUnicode_GET_LENGTH(key);
        else goto python;
        if (len == 0 || len > max_key) goto python;
        chars += len;
        count++;
    }
    if (count >= room || chars >= chars_room) goto python;
    /* Each new key's id: from `old`, else hashed; keys of one block (at most 128 bytes, bytes or
       ASCII str) four at a time, the others one by one. Then all cached and written in order. */
    kids = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    pending = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(Py_ssize_t));
    if (!kids || !pending) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t waiting = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(out, i) != Py_None) continue;
        PyObject *key = items[i];
        int one_block = PyBytes_CheckExact(key) ? PyBytes_GET_SIZE(key) <= 128
                                                : PyUnicode_IS_ASCII(key) && PyUnicode_GET_LENGTH(key) <= 128;
        if (!one_block) { /* (a key of one block hashes in about the time a lookup in `old` takes) */
            PyObject *kid = PyDict_GetItemWithError(old, key);
            if (kid) {
                Py_INCREF(kid);
                kids[i] = kid;
                continue;
            }
            if (PyErr_Occurred()) goto fail;
        }
        if (one_block) {
            kids[i] = PyBytes_FromStringAndSize(NULL, ID_BYTES);
            if (!kids[i]) goto fail;
            pending[waiting++] = i;
        } else if (!(kids[i] = id_of_key(key))) {
            goto fail;
        }
    }
    for (Py_ssize_t at = 0; at < waiting; at += 4) {
        const uint64_t *start[4];
        const uint8_t *data[4];
        size_t len[4];
        uint8_t *ids[4];
        for (int k = 0; k < 4; k++) {
            Py_ssize_t i = pending[at + k < waiting ? at + k : at]; /* (a short last group repeats its first) */
            PyObject *key = items[i];
            if (PyBytes_CheckExact(key)) {
                start[k] = BYTES_STATE;
                data[k] = (const uint8_t *)PyBytes_AS_STRING(key);
                len[k] = (size_t)PyBytes_GET_SIZE(key);
            } else {
                start[k] = STR_STATE;
                data[k] = (const uint8_t *)PyUnicode_DATA(key);
                len[k] = (size_t)PyUnicode_GET_LENGTH(key);
            }
            ids[k] = (uint8_t *)PyBytes_AS_STRING(kids[i]);
        }
        digest4(start, data, len, ids);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!kids[i]) continue;
        if (PyDict_SetItem(young, items[i], kids[i]) < 0) goto fail;
        PyList_SetItem(out, i, kids[i]); /* (steals the reference; drops the None) */
        kids[i] = NULL;
    }
    PyMem_Free(kids);
    PyMem_Free(pending);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(chars);
python:
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    if (kids)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(kids[i]);
    PyMem_Free(kids);
    PyMem_Free(pending);
    Py_DECREF(seq);
    return NULL;
}

/* ---- the compact key table ---- */

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is no whole number of %zd-byte items", what, view->len, itemsize);
        return -1;
    }
    return 0;
}

/* The writable buffers of `k` objects (names and item sizes alongside): all held, or none with
   an error set. */
static int hold_all(PyObject *const *objs, Py_buffer *const *views, const Py_ssize_t *itemsizes,
                    const char *const *names, int k) {
    for (int i = 0; i < k; i++) {
        if (writable(objs[i], views[i], itemsizes[i], names[i]) < 0) {
            while (i--) PyBuffer_Release(views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_all(Py_buffer *const *views, int k) {
    for (int i = 0; i < k; i++) PyBuffer_Release(views[i]);
}

typedef struct {
    PyObject_HEAD
    Py_buffer buckets, ids, bucket_of, home; /* int32, uint8 (16 a slot), int32, int32 */
    int held;
    uint64_t mask;
    Py_ssize_t capacity;
} Table;

#define TABLE_VIEWS(t) {&(t)->buckets, &(t)->ids, &(t)->bucket_of, &(t)->home}

static void table_release(Table *t) {
    if (t->held) {
        Py_buffer *views[] = TABLE_VIEWS(t);
        release_all(views, 4);
        t->held = 0;
    }
}

static void table_dealloc(Table *t) {
    table_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int table_init(Table *t, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *b, *i, *bo, *h;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "OOOOK", &b, &i, &bo, &h, &mask)) return -1;
    table_release(t);
    PyObject *objs[] = {b, i, bo, h};
    Py_buffer *views[] = TABLE_VIEWS(t);
    const Py_ssize_t sizes[] = {4, ID_BYTES, 4, 4};
    const char *names[] = {"buckets", "ids", "bucket_of", "home"};
    if (hold_all(objs, views, sizes, names, 4) < 0) return -1;
    t->held = 1;
    t->mask = mask;
    t->capacity = t->bucket_of.len / 4;
    if ((Py_ssize_t)(mask + 1) * 4 != t->buckets.len || t->ids.len != t->capacity * ID_BYTES
        || t->home.len != t->capacity * 4) {
        table_release(t);
        PyErr_SetString(PyExc_ValueError, "Table: buffers of mismatched sizes");
        return -1;
    }
    return 0;
}

/* The slot holding the 16-byte id `kid` (home bucket `home`), or EMPTY; with `at`, the bucket
   where the probe stopped (the id's or the first empty one). */
static inline int32_t probe(Table *t, const char *kid, uint64_t home, uint64_t *at) {
    const int32_t *buckets = (const int32_t *)t->buckets.buf;
    const char *ids = (const char *)t->ids.buf;
    uint64_t b = home;
    for (;;) {
        int32_t slot = buckets[b];
        if (slot == EMPTY || memcmp(ids + (size_t)slot * ID_BYTES, kid, ID_BYTES) == 0) {
            if (at) *at = b;
            return slot;
        }
        b = (b + 1) & t->mask;
    }
}

/* The home bucket of `kid` (Python's hash of it, masked); -1 with an error set, or -2 when it
   is no 16-byte bytes object. */
static inline int64_t home_of(Table *t, PyObject *kid) {
    if (!PyBytes_CheckExact(kid) || PyBytes_GET_SIZE(kid) != ID_BYTES) return -2;
    Py_hash_t h = PyObject_Hash(kid);
    if (h == -1 && PyErr_Occurred()) return -1;
    return (int64_t)((uint64_t)h & t->mask);
}

static int check_held(Table *t) {
    if (!t->held) {
        PyErr_SetString(PyExc_ValueError, "Table: not initialised");
        return -1;
    }
    return 0;
}

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* Ids looked up a group at a time: a table of millions of slots lives in DRAM, and one probe
   after the other would wait for each cache miss in turn. */
#define GROUP 64

/* The home bucket of each of `k` (at most GROUP) ids (as home_of: -2 for no 16-byte bytes
   object) into `homes`, with each home bucket and then the id its slot holds asked from memory
   ahead of the probes, so that the group's misses overlap; -1 with an error set. */
static int homes_ahead(Table *t, PyObject *const *kids, Py_ssize_t k, int64_t *homes) {
    const int32_t *buckets = (const int32_t *)t->buckets.buf;
    const char *ids = (const char *)t->ids.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        homes[i] = home_of(t, kids[i]);
        if (homes[i] == -1) return -1;
        if (homes[i] >= 0) PREFETCH(buckets + homes[i]);
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (homes[i] < 0) continue;
        int32_t slot = buckets[homes[i]];
        if (slot != EMPTY) PREFETCH(ids + (size_t)slot * ID_BYTES);
    }
    return 0;
}

/* get(kids, out=None, leading=False): the slot of each id, or -1 (an id that is no 16-byte
   bytes object is not in the table). With `out` (a writable int64 buffer of len(kids) items),
   written there and None returned; else a list. With `leading`, the slots of the ids up to the
   first miss, as a list. */
static PyObject *table_get(Table *t, PyObject *args) {
    PyObject *kids, *outobj = Py_None;
    int leading = 0;
    if (!PyArg_ParseTuple(args, "O|Op", &kids, &outobj, &leading)) return NULL;
    if (check_held(t) < 0) return NULL;
    PyObject *seq = PySequence_Fast(kids, "ids must be a list or tuple");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer out;
    int64_t *dst = NULL;
    PyObject *list = NULL;
    if (outobj != Py_None) {
        if (PyObject_GetBuffer(outobj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail_seq;
        if (out.len != n * 8) {
            PyBuffer_Release(&out);
            PyErr_SetString(PyExc_ValueError, "out must hold one int64 per id");
            goto fail_seq;
        }
        dst = (int64_t *)out.buf;
    } else {
        list = PyList_New(leading ? 0 : n);
        if (!list) goto fail_seq;
    }
    int64_t homes[GROUP];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % GROUP == 0 && homes_ahead(t, items + i, n - i < GROUP ? n - i : GROUP, homes) < 0) goto fail;
        int64_t home = homes[i % GROUP];
        int32_t slot = home == -2 ? EMPTY : probe(t, PyBytes_AS_STRING(items[i]), (uint64_t)home, NULL);
        if (dst) {
            dst[i] = slot;
            continue;
        }
        if (leading && slot == EMPTY) break;
        PyObject *num = PyLong_FromLong(slot);
        if (!num) goto fail;
        if (leading) {
            int rc = PyList_Append(list, num);
            Py_DECREF(num);
            if (rc < 0) goto fail;
        } else {
            PyList_SET_ITEM(list, i, num);
        }
    }
    Py_DECREF(seq);
    if (dst) {
        PyBuffer_Release(&out);
        Py_RETURN_NONE;
    }
    return list;
fail:
    if (dst) PyBuffer_Release(&out);
    Py_XDECREF(list);
fail_seq:
    Py_DECREF(seq);
    return NULL;
}

/* bind(kids, slots) -> int: binds each (id, slot) pair in order, as KeyTable.bind would, and
   stops before the first pair that bind would refuse (a slot out of range or holding a key, an
   id of another size or already mapped): returns how many pairs it bound. */
static PyObject *table_bind(Table *t, PyObject *args) {
    PyObject *kids, *slots;
    if (!PyArg_ParseTuple(args, "OO", &kids, &slots)) return NULL;
    if (check_held(t) < 0) return NULL;
    PyObject *ks = PySequence_Fast(kids, "ids must be a list or tuple");
    if (!ks) return NULL;
    PyObject *ss = PySequence_Fast(slots, "slots must be a list or tuple");
    if (!ss) {
        Py_DECREF(ks);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ks);
    if (PySequence_Fast_GET_SIZE(ss) < n) n = PySequence_Fast_GET_SIZE(ss);
    PyObject **ki = PySequence_Fast_ITEMS(ks), **si = PySequence_Fast_ITEMS(ss);
    int32_t *buckets = (int32_t *)t->buckets.buf, *bucket_of = (int32_t *)t->bucket_of.buf;
    int32_t *home_arr = (int32_t *)t->home.buf;
    char *ids = (char *)t->ids.buf;
    Py_ssize_t bound = 0;
    for (; bound < n; bound++) {
        long slot = PyLong_AsLong(si[bound]);
        if (slot == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            break; /* KeyTable.bind names it */
        }
        if (slot < 0 || slot >= t->capacity || bucket_of[slot] != EMPTY) break;
        int64_t home = home_of(t, ki[bound]);
        if (home == -1) goto fail;
        if (home == -2) break;
        uint64_t at;
        const char *kid = PyBytes_AS_STRING(ki[bound]);
        if (probe(t, kid, (uint64_t)home, &at) != EMPTY) break;
        buckets[at] = (int32_t)slot;
        memcpy(ids + (size_t)slot * ID_BYTES, kid, ID_BYTES);
        bucket_of[slot] = (int32_t)at;
        home_arr[slot] = (int32_t)home;
    }
    Py_DECREF(ks);
    Py_DECREF(ss);
    return PyLong_FromSsize_t(bound);
fail:
    Py_DECREF(ks);
    Py_DECREF(ss);
    return NULL;
}

/* Forgets the key of `slot` (in range) with a backward shift, as KeyTable.unbind; whether it
   held one. */
static int unbind_one(Table *t, long slot) {
    int32_t *buckets = (int32_t *)t->buckets.buf, *bucket_of = (int32_t *)t->bucket_of.buf;
    const int32_t *home_arr = (const int32_t *)t->home.buf;
    int32_t hole = bucket_of[slot];
    if (hole == EMPTY) return 0;
    bucket_of[slot] = EMPTY;
    buckets[hole] = EMPTY;
    uint64_t mask = t->mask, h = (uint64_t)hole, b = (h + 1) & mask;
    for (;;) {
        int32_t other = buckets[b];
        if (other == EMPTY) break;
        uint64_t home = (uint64_t)home_arr[other];
        if (((b - home) & mask) >= ((b - h) & mask)) {
            buckets[h] = other;
            bucket_of[other] = (int32_t)h;
            buckets[b] = EMPTY;
            h = b;
        }
        b = (b + 1) & mask;
    }
    return 1;
}

/* unbind(slot) -> bool: unbind_one of one slot. */
static PyObject *table_unbind(Table *t, PyObject *arg) {
    if (check_held(t) < 0) return NULL;
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= t->capacity) {
        PyErr_Format(PyExc_IndexError, "slot %ld out of range", slot);
        return NULL;
    }
    return PyBool_FromLong(unbind_one(t, slot));
}

/* ids_of(slots) -> list[bytes] | int: the id each slot holds, in order; where a slot holds no
   key, its position instead (KeyTable.ids_of names it). */
static PyObject *table_ids_of(Table *t, PyObject *obj);

/* unbind_many(slots) -> int: unbind of each slot in order; how many held a key. */
static PyObject *table_unbind_many(Table *t, PyObject *obj);

static PyMethodDef table_methods[] = {
    {"unbind_many", (PyCFunction)table_unbind_many, METH_O, "unbind_many(slots) -> slots that held a key"},
    {"ids_of", (PyCFunction)table_ids_of, METH_O, "ids_of(slots) -> list of ids, or the position of a slot without one"},
    {"get", (PyCFunction)table_get, METH_VARARGS, "get(ids, out=None, leading=False)"},
    {"bind", (PyCFunction)table_bind, METH_VARARGS, "bind(ids, slots) -> pairs bound"},
    {"unbind", (PyCFunction)table_unbind, METH_O, "unbind(slot) -> whether it held a key"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_kvtier_host.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The probes of one KeyTable's buffers.",
    .tp_methods = table_methods,
    .tp_init = (initproc)table_init,
    .tp_new = PyType_GenericNew,
};

/* ---- the slot lists (kvtier.index.slot_list.SlotList) ---- */

typedef struct {
    PyObject_HEAD
    Py_buffer next, prev, member, stamp; /* int32 and int32 (capacity + 1: the last is the
                                            sentinel), uint8 (capacity + 1), int64 (capacity) */
    int held;
    Py_ssize_t capacity;
} Links;

#define LINKS_VIEWS(l) {&(l)->next, &(l)->prev, &(l)->member, &(l)->stamp}

static void links_release(Links *l) {
    if (l->held) {
        Py_buffer *views[] = LINKS_VIEWS(l);
        release_all(views, 4);
        l->held = 0;
    }
}

static void links_dealloc(Links *l) {
    links_release(l);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static int links_init(Links *l, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *n, *p, *m, *s;
    if (!PyArg_ParseTuple(args, "OOOO", &n, &p, &m, &s)) return -1;
    links_release(l);
    PyObject *objs[] = {n, p, m, s};
    Py_buffer *views[] = LINKS_VIEWS(l);
    const Py_ssize_t sizes[] = {4, 4, 1, 8};
    const char *names[] = {"next", "prev", "member", "stamp"};
    if (hold_all(objs, views, sizes, names, 4) < 0) return -1;
    l->held = 1;
    l->capacity = l->stamp.len / 8;
    if (l->next.len != (l->capacity + 1) * 4 || l->prev.len != l->next.len || l->member.len != l->capacity + 1) {
        links_release(l);
        PyErr_SetString(PyExc_ValueError, "Links: buffers of mismatched sizes");
        return -1;
    }
    return 0;
}

/* A slots argument: `at[0..n)` as int64s, an int64 buffer (a numpy array) read in place, else a
   sequence of ints copied into `owned`. */
typedef struct {
    Py_buffer view;
    int viewing;
    const int64_t *at;
    int64_t *owned;
    Py_ssize_t n;
} Slots;

static void slots_release(Slots *arg) {
    if (arg->viewing) PyBuffer_Release(&arg->view);
    PyMem_Free(arg->owned);
    arg->viewing = 0;
    arg->owned = NULL;
}

/* Reads `obj` into `arg`; -1 with an error set (nothing held), e.g. for a slot out of
   [0, capacity). */
static int slots_arg(PyObject *obj, Py_ssize_t capacity, Slots *arg) {
    arg->viewing = 0;
    arg->owned = NULL;
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &arg->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        const char *f = arg->view.format ? arg->view.format : "B";
        if (arg->view.itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0 || strcmp(f, "<q") == 0
                                        || strcmp(f, "<l") == 0 || strcmp(f, "=q") == 0 || strcmp(f, "=l") == 0)) {
            arg->viewing = 1;
            arg->at = (const int64_t *)arg->view.buf;
            arg->n = arg->view.len / 8;
        } else {
            PyBuffer_Release(&arg->view);
        }
    }
    if (!arg->viewing) {
        PyErr_Clear();
        PyObject *seq = PySequence_Fast(obj, "slots must be a sequence of ints");
        if (!seq) return -1;
        arg->n = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        arg->owned = PyMem_Malloc((size_t)(arg->n ? arg->n : 1) * sizeof(int64_t));
        if (!arg->owned) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < arg->n; i++) {
            long long v = PyLong_AsLongLong(items[i]);
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                slots_release(arg);
                return -1;
            }
            arg->owned[i] = v;
        }
        Py_DECREF(seq);
        arg->at = arg->owned;
    }
    for (Py_ssize_t i = 0; i < arg->n; i++) {
        if (arg->at[i] < 0 || arg->at[i] >= capacity) {
            PyErr_Format(PyExc_IndexError, "slot %lld out of range [0, %zd)", (long long)arg->at[i], capacity);
            slots_release(arg);
            return -1;
        }
    }
    return 0;
}

static PyObject *table_ids_of(Table *t, PyObject *obj) {
    if (check_held(t) < 0) return NULL;
    Slots arg;
    if (slots_arg(obj, t->capacity, &arg) < 0) return NULL;
    const int32_t *bucket_of = (const int32_t *)t->bucket_of.buf;
    const char *ids = (const char *)t->ids.buf;
    PyObject *out = PyList_New(arg.n);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < arg.n; i++) {
        int64_t slot = arg.at[i];
        if (bucket_of[slot] == EMPTY) {
            Py_DECREF(out);
            out = PyLong_FromSsize_t(i);
            goto done;
        }
        PyObject *kid = PyBytes_FromStringAndSize(ids + (size_t)slot * ID_BYTES, ID_BYTES);
        if (!kid) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, kid);
    }
done:
    slots_release(&arg);
    return out;
}

static PyObject *table_unbind_many(Table *t, PyObject *obj) {
    if (check_held(t) < 0) return NULL;
    Slots arg;
    if (slots_arg(obj, t->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; i < n; i++) held += unbind_one(t, (long)slots[i]);
    slots_release(&arg);
    return PyLong_FromSsize_t(held);
}

/* ---- page states (kvtier.index.tier_index.TierIndex.set_states) ---- */

#define STATES 6
#define FREE_STATE 0
#define DIRTY_STATE 4

typedef struct {
    PyObject_HEAD
    Py_buffer state, pins, busy, hits; /* uint8, int32, int32, uint8: one a slot */
    int held;
    Py_ssize_t capacity;
    uint8_t legal[STATES * STATES]; /* legal[old * STATES + new] */
    uint8_t evictable[STATES];
    uint32_t *seen; /* scratch: the call that last saw each slot */
    uint32_t call;
} States;

#define STATES_VIEWS(st) {&(st)->state, &(st)->pins, &(st)->busy, &(st)->hits}

static void states_release(States *st) {
    if (st->held) {
        Py_buffer *views[] = STATES_VIEWS(st);
        release_all(views, 4);
        st->held = 0;
    }
    PyMem_Free(st->seen);
    st->seen = NULL;
}

static void states_dealloc(States *st) {
    states_release(st);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

static int states_init(States *st, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *a, *p, *b, *h;
    Py_buffer legal, evictable;
    if (!PyArg_ParseTuple(args, "OOOOy*y*", &a, &p, &b, &h, &legal, &evictable)) return -1;
    states_release(st);
    int ok = legal.len == STATES * STATES && evictable.len == STATES;
    if (ok) {
        memcpy(st->legal, legal.buf, STATES * STATES);
        memcpy(st->evictable, evictable.buf, STATES);
    }
    PyBuffer_Release(&legal);
    PyBuffer_Release(&evictable);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "States: legal must be 36 bytes and evictable 6");
        return -1;
    }
    PyObject *objs[] = {a, p, b, h};
    Py_buffer *views[] = STATES_VIEWS(st);
    const Py_ssize_t sizes[] = {1, 4, 4, 1};
    const char *names[] = {"state", "pins", "busy", "hits"};
    if (hold_all(objs, views, sizes, names, 4) < 0) return -1;
    st->held = 1;
    st->capacity = st->state.len;
    if (st->pins.len != st->capacity * 4 || st->busy.len != st->capacity * 4 || st->hits.len != st->capacity) {
        states_release(st);
        PyErr_SetString(PyExc_ValueError, "States: buffers of mismatched sizes");
        return -1;
    }
    st->seen = PyMem_Calloc((size_t)(st->capacity ? st->capacity : 1), sizeof(uint32_t));
    st->call = 0;
    if (!st->seen) {
        states_release(st);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int repeats(States *st, const int64_t *slots, Py_ssize_t n);

/* [left[0], ..., left[STATES - 1]] as a list, or NULL with an error set. */
static PyObject *state_counts(const Py_ssize_t *left) {
    PyObject *counts = PyList_New(STATES);
    if (!counts) return NULL;
    for (int k = 0; k < STATES; k++) {
        PyObject *num = PyLong_FromSsize_t(left[k]);
        if (!num) {
            Py_DECREF(counts);
            return NULL;
        }
        PyList_SET_ITEM(counts, k, num);
    }
    return counts;
}

static int append_slot(PyObject *list, int64_t slot) {
    PyObject *num = PyLong_FromLongLong(slot);
    if (!num) return -1;
    int rc = PyList_Append(list, num);
    Py_DECREF(num);
    return rc;
}

/* set(slots, new, busy_delta) -> None | (left, adds, removes, undirty, freed, busy_change):
   TierIndex.set_states' loops over distinct slots, applied to the arrays here. None, with nothing
   changed, when a slot repeats, a transition is illegal, a slot to free is held or busy, or a
   copy count would go below zero: the Python loops apply repeats in order and name the fault.
   Else: how many slots left each state, the slots joining and leaving the eviction order (in
   order), those that were DIRTY (off the dirty list), those freed (to unbind, in order, and
   push on the free list) and the change in busy slots. */
static PyObject *states_set(States *st, PyObject *args) {
    PyObject *obj;
    int new_state, delta;
    if (!PyArg_ParseTuple(args, "Oii", &obj, &new_state, &delta)) return NULL;
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    if (new_state < 0 || new_state >= STATES) return PyErr_Format(PyExc_ValueError, "no state %d", new_state);
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    uint8_t *state = (uint8_t *)st->state.buf, *hits = (uint8_t *)st->hits.buf;
    int32_t *pins = (int32_t *)st->pins.buf, *busy = (int32_t *)st->busy.buf;
    PyObject *adds = NULL, *removes = NULL, *undirty = NULL, *freed = NULL, *out = NULL;
    if (repeats(st, slots, n)) goto python;
    for (Py_ssize_t i = 0; i < n; i++) { /* check everything before changing anything */
        int64_t slot = slots[i];
        uint8_t old = state[slot];
        if (old >= STATES || !st->legal[old * STATES + new_state]) goto python;
        if (new_state == FREE_STATE) {
            if (pins[slot] || busy[slot] + delta) goto python;
        } else if (busy[slot] + delta < 0) {
            goto python;
        }
    }
    adds = PyList_New(0);
    removes = PyList_New(0);
    undirty = PyList_New(0);
    freed = PyList_New(0);
    if (!adds || !removes || !undirty || !freed) goto fail;
    Py_ssize_t left[STATES] = {0};
    long busy_change = 0;
    uint8_t evictable_new = st->evictable[new_state];
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        uint8_t old = state[slot];
        left[old]++;
        if (old == DIRTY_STATE && append_slot(undirty, slot) < 0) goto fail;
        if (new_state == FREE_STATE) {
            if (delta) {
                busy[slot] = 0;
                busy_change--;
            } else if (st->evictable[old] && append_slot(removes, slot) < 0) {
                goto fail;
            }
            state[slot] = FREE_STATE;
            hits[slot] = 0;
            if (append_slot(freed, slot) < 0) goto fail;
            continue;
        }
        state[slot] = (uint8_t)new_state;
        if (!delta) {
            if (evictable_new != st->evictable[old] && !busy[slot] && !pins[slot]
                && append_slot(evictable_new ? adds : removes, slot) < 0)
                goto fail;
            continue;
        }
        int32_t before = busy[slot], after = before + delta;
        busy[slot] = after;
        if (!before) {
            busy_change++;
            if (st->evictable[old] && !pins[slot] && append_slot(removes, slot) < 0) goto fail;
        } else if (!after) {
            busy_change--;
            if (evictable_new && !pins[slot] && append_slot(adds, slot) < 0) goto fail;
        }
    }
    PyObject *counts = state_counts(left);
    if (!counts) goto fail;
    out = Py_BuildValue("(NNNNNl)", counts, adds, removes, undirty, freed, busy_change);
    slots_release(&arg);
    return out;
python:
    slots_release(&arg);
    Py_RETURN_NONE;
fail: /* (only memory runs out here; the arrays are left as far as the loop went) */
    Py_XDECREF(adds);
    Py_XDECREF(removes);
    Py_XDECREF(undirty);
    Py_XDECREF(freed);
    slots_release(&arg);
    return NULL;
}

/* Marks `slots` as seen by a new call; 0, or 1 when one repeats (then the caller hands the
   batch to the Python loops). */
static int repeats(States *st, const int64_t *slots, Py_ssize_t n) {
    if (++st->call == 0) {
        memset(st->seen, 0, (size_t)st->capacity * sizeof(uint32_t));
        st->call = 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (st->seen[slots[i]] == st->call) return 1;
        st->seen[slots[i]] = st->call;
    }
    return 0;
}

/* hold(slots, touch) -> int: a copy starts using each slot (busy + 1; with `touch`, hits + 1 up
   to 255), in order, as TierIndex.hold_all's loop; how many slots were idle before. */
static PyObject *states_hold(States *st, PyObject *args) {
    PyObject *obj;
    int touch;
    if (!PyArg_ParseTuple(args, "Op", &obj, &touch)) return NULL;
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    int32_t *busy = (int32_t *)st->busy.buf;
    uint8_t *hits = (uint8_t *)st->hits.buf;
    Py_ssize_t idle = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        if (!busy[slot]) idle++;
        busy[slot]++;
        if (touch && hits[slot] < 255) hits[slot]++;
    }
    slots_release(&arg);
    return PyLong_FromSsize_t(idle);
}

/* unhold(slots) -> None | (adds, idle): a copy stops using each of distinct slots that all
   have one (else None, nothing changed: the loop names the slot); the slots that turn idle,
   unheld and evictable (to join the eviction order, in order) and how many turned idle. */
static PyObject *states_unhold(States *st, PyObject *obj) {
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    int32_t *busy = (int32_t *)st->busy.buf, *pins = (int32_t *)st->pins.buf;
    const uint8_t *state = (const uint8_t *)st->state.buf;
    PyObject *adds = NULL;
    if (repeats(st, slots, n)) goto python;
    for (Py_ssize_t i = 0; i < n; i++)
        if (busy[slots[i]] < 1) goto python;
    adds = PyList_New(0);
    if (!adds) goto fail;
    Py_ssize_t idle = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        if (--busy[slot]) continue;
        idle++;
        if (!pins[slot] && state[slot] < STATES && st->evictable[state[slot]] && append_slot(adds, slot) < 0) goto fail;
    }
    slots_release(&arg);
    return Py_BuildValue("(Nn)", adds, idle);
python:
    slots_release(&arg);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(adds);
    slots_release(&arg);
    return NULL;
}

/* unpin(slots) -> None | (adds, idle_filling, unheld): one engine hold dropped from each of
   distinct slots that all have one (else None, nothing changed: the loop names the slot); the
   slots that turn unheld, idle and evictable (to join the eviction order), those left unheld and
   idle in FILLING (the caller frees them), and how many turned unheld. */
static PyObject *states_unpin(States *st, PyObject *obj) {
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    int32_t *busy = (int32_t *)st->busy.buf, *pins = (int32_t *)st->pins.buf;
    const uint8_t *state = (const uint8_t *)st->state.buf;
    PyObject *adds = NULL, *filling = NULL;
    if (repeats(st, slots, n)) goto python;
    for (Py_ssize_t i = 0; i < n; i++)
        if (pins[slots[i]] < 1) goto python;
    adds = PyList_New(0);
    filling = PyList_New(0);
    if (!adds || !filling) goto fail;
    Py_ssize_t unheld = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        if (--pins[slot]) continue;
        unheld++;
        if (busy[slot]) continue;
        uint8_t now = state[slot];
        if (now < STATES && st->evictable[now]) {
            if (append_slot(adds, slot) < 0) goto fail;
        } else if (now == 1 /* FILLING */ && append_slot(filling, slot) < 0) {
            goto fail;
        }
    }
    slots_release(&arg);
    return Py_BuildValue("(NNn)", adds, filling, unheld);
python:
    slots_release(&arg);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(adds);
    Py_XDECREF(filling);
    slots_release(&arg);
    return NULL;
}

/* reuse(slots, new, busy_delta) -> None | (left, undirty): TierIndex.reuse's loop over distinct
   slots that are all evictable, unheld and idle (else None, nothing changed: the loop names the
   slot): each slot's hits cleared, state `new`, `busy_delta` copies on it; how many slots left
   each state and those that were DIRTY (the caller drops them from the dirty list and the
   eviction order, and unbinds them, in order). */
static PyObject *states_reuse(States *st, PyObject *args) {
    PyObject *obj;
    int new_state, delta;
    if (!PyArg_ParseTuple(args, "Oii", &obj, &new_state, &delta)) return NULL;
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    if (new_state < 0 || new_state >= STATES) return PyErr_Format(PyExc_ValueError, "no state %d", new_state);
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    uint8_t *state = (uint8_t *)st->state.buf, *hits = (uint8_t *)st->hits.buf;
    int32_t *pins = (int32_t *)st->pins.buf, *busy = (int32_t *)st->busy.buf;
    PyObject *undirty = NULL, *counts = NULL;
    if (repeats(st, slots, n)) goto python;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        if (state[slot] >= STATES || !st->evictable[state[slot]] || pins[slot] || busy[slot]) goto python;
    }
    undirty = PyList_New(0);
    if (!undirty) goto fail;
    Py_ssize_t left[STATES] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = slots[i];
        uint8_t old = state[slot];
        left[old]++;
        if (old == DIRTY_STATE && append_slot(undirty, slot) < 0) goto fail;
        hits[slot] = 0;
        state[slot] = (uint8_t)new_state;
        if (delta) busy[slot] = delta;
    }
    counts = state_counts(left);
    if (!counts) goto fail;
    slots_release(&arg);
    return Py_BuildValue("(NN)", counts, undirty);
python:
    slots_release(&arg);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(undirty);
    Py_XDECREF(counts);
    slots_release(&arg);
    return NULL;
}

/* mark(slots, state, busy, pins): each slot's state, copies and holds set, no check (free
   slots taken: TierIndex.take_free and take_loading). */
static PyObject *states_mark(States *st, PyObject *args) {
    PyObject *obj;
    int new_state, busy_to, pins_to;
    if (!PyArg_ParseTuple(args, "Oiii", &obj, &new_state, &busy_to, &pins_to)) return NULL;
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    if (new_state < 0 || new_state >= STATES) return PyErr_Format(PyExc_ValueError, "no state %d", new_state);
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    uint8_t *state = (uint8_t *)st->state.buf;
    int32_t *pins = (int32_t *)st->pins.buf, *busy = (int32_t *)st->busy.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        state[slots[i]] = (uint8_t)new_state;
        busy[slots[i]] = busy_to;
        pins[slots[i]] = pins_to;
    }
    slots_release(&arg);
    Py_RETURN_NONE;
}

static PyTypeObject StatesType;

/* The slots of `obj` when it is a list or tuple of exact ints in [0, capacity): 1 (then
   slots_release), 0 when it is not (no error set: the caller's Python path names the fault), -1
   with an error set. */
static int exact_slots(PyObject *obj, Py_ssize_t capacity, Slots *arg) {
    arg->viewing = 0;
    arg->owned = NULL;
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject **items = PySequence_Fast_ITEMS(obj);
    arg->owned = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!arg->owned) {
        PyErr_NoMemory();
        return -1;
    }
    arg->n = n;
    arg->at = arg->owned;
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        long long v = PyLong_CheckExact(items[i]) ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : -1;
        if (v < 0 || v >= capacity) { /* (overflow reads -1) */
            slots_release(arg);
            return 0;
        }
        arg->owned[i] = v;
    }
    return 1;
}

#define FILLING_STATE 1
#define RESIDENT_STATE 3
#define READABLE(s) ((s) >= RESIDENT_STATE && (s) < STATES) /* RESIDENT, DIRTY, OFFLOADING */

/* commit(slots, ids, table, host_table, host_states) -> None | (dirty, absent_slots, absent_ids,
   keyed, clean): TieredPool.commit's bookkeeping of fresh device slots in one pass (its slot
   checks, its freshness check and _key_commit), on these arrays (the device tier's), the device
   key table `table`, and the host tier's key table and States. `ids`: distinct 16-byte ids (the
   caller checked them), one a slot. None, with nothing changed, when the slots are no list of
   ints in range, one repeats, or one is not an allocated, uncommitted slot the engine holds
   (FILLING, held, no copy in flight, no key), or the counts differ: the Python path names the
   fault. Else each id the device table lacks is bound to its slot, which turns RESIDENT where
   the host tier holds the id readable and DIRTY otherwise (a held slot joins no eviction order);
   returns the slots turned DIRTY (for the dirty list, in order), the slots and ids the host tier
   lacks (in order), how many slots were keyed and how many of those turned RESIDENT. */
static PyObject *states_commit(States *st, PyObject *args) {
    PyObject *obj, *ids;
    Table *t, *ht;
    States *hs;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!", &obj, &PyList_Type, &ids, &TableType, &t, &TableType, &ht,
                          &StatesType, &hs))
        return NULL;
    if (!st->held || !hs->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    if (check_held(t) < 0 || check_held(ht) < 0) return NULL;
    if (t->capacity != st->capacity || ht->capacity != hs->capacity)
        return PyErr_Format(PyExc_ValueError, "commit: key tables and states of different capacities");
    Slots arg;
    int got = exact_slots(obj, st->capacity, &arg);
    if (got <= 0) {
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    PyObject *dirty = NULL, *absent_slots = NULL, *absent_ids = NULL;
    int64_t *homes = NULL;
    const uint8_t *state = (const uint8_t *)st->state.buf, *hstate = (const uint8_t *)hs->state.buf;
    const int32_t *pins = (const int32_t *)st->pins.buf, *busy = (const int32_t *)st->busy.buf;
    const int32_t *bucket_of = (const int32_t *)t->bucket_of.buf;
    if (PyList_GET_SIZE(ids) != n || repeats(st, slots, n)) goto python;
    for (Py_ssize_t i = 0; i < n; i++) { /* check everything before changing anything */
        int64_t slot = slots[i];
        if (state[slot] != FILLING_STATE || pins[slot] <= 0 || busy[slot] || bucket_of[slot] != EMPTY) goto python;
    }
    /* Each id's home bucket in the device table (its hash, masked), or -1: on the device already
       (a duplicate commit, which keeps its slot); and where the host tier holds it, or EMPTY. */
    homes = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(int64_t));
    if (!homes) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t *hosts = homes + n;
    Py_ssize_t keyed = 0, clean = 0, absent = 0;
    PyObject **kids = PySequence_Fast_ITEMS(ids);
    int64_t dev_homes[GROUP], host_homes[GROUP];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % GROUP == 0) {
            Py_ssize_t k = n - i < GROUP ? n - i : GROUP;
            if (homes_ahead(t, kids + i, k, dev_homes) < 0 || homes_ahead(ht, kids + i, k, host_homes) < 0) goto fail;
        }
        PyObject *kid = kids[i];
        int64_t home = dev_homes[i % GROUP];
        if (home == -2) goto python;
        const char *raw = PyBytes_AS_STRING(kid);
        homes[i] = probe(t, raw, (uint64_t)home, NULL) == EMPTY ? home : -1;
        if (homes[i] < 0) continue;
        hosts[i] = probe(ht, raw, (uint64_t)host_homes[i % GROUP], NULL);
        keyed++;
        if (hosts[i] == EMPTY) absent++;
        else if (READABLE(hstate[hosts[i]])) clean++;
    }
    /* The answers built whole before any change, so nothing below can fail. */
    dirty = PyList_New(keyed - clean);
    absent_slots = PyList_New(absent);
    absent_ids = PyList_New(absent);
    if (!dirty || !absent_slots || !absent_ids) goto fail;
    for (Py_ssize_t i = 0, d = 0, a = 0; i < n; i++) {
        if (homes[i] < 0) continue;
        int is_clean = hosts[i] != EMPTY && READABLE(hstate[hosts[i]]);
        if (!is_clean) {
            PyObject *num = PyLong_FromLongLong(slots[i]);
            if (!num) goto fail;
            PyList_SET_ITEM(dirty, d++, num);
        }
        if (hosts[i] == EMPTY) {
            PyObject *num = PyLong_FromLongLong(slots[i]);
            if (!num) goto fail;
            PyList_SET_ITEM(absent_slots, a, num);
            PyObject *kid = PyList_GET_ITEM(ids, i);
            Py_INCREF(kid);
            PyList_SET_ITEM(absent_ids, a++, kid);
        }
    }
    uint8_t *wstate = (uint8_t *)st->state.buf;
    int32_t *buckets = (int32_t *)t->buckets.buf, *wbucket_of = (int32_t *)t->bucket_of.buf;
    int32_t *home_arr = (int32_t *)t->home.buf;
    char *table_ids = (char *)t->ids.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (homes[i] < 0) continue;
        int64_t slot = slots[i];
        const char *raw = PyBytes_AS_STRING(PyList_GET_ITEM(ids, i));
        uint64_t b;
        probe(t, raw, (uint64_t)homes[i], &b); /* the first empty bucket of its run now */
        buckets[b] = (int32_t)slot;
        memcpy(table_ids + (size_t)slot * ID_BYTES, raw, ID_BYTES);
        wbucket_of[slot] = (int32_t)b;
        home_arr[slot] = (int32_t)homes[i];
        wstate[slot] = hosts[i] != EMPTY && READABLE(hstate[hosts[i]]) ? RESIDENT_STATE : DIRTY_STATE;
    }
    PyMem_Free(homes);
    slots_release(&arg);
    return Py_BuildValue("(NNNnn)", dirty, absent_slots, absent_ids, keyed, clean);
python:
    PyMem_Free(homes);
    slots_release(&arg);
    Py_RETURN_NONE;
fail: /* (before any change: memory ran out, or an id's hash failed) */
    PyMem_Free(homes);
    Py_XDECREF(dirty);
    Py_XDECREF(absent_slots);
    Py_XDECREF(absent_ids);
    slots_release(&arg);
    return NULL;
}

/* hold_keyed(ids, table, touch) -> None | (slots, idle): TierIndex.hold_readable of distinct
   16-byte ids on these arrays and their key table: when every id is keyed in `table` and its
   slot readable (RESIDENT, DIRTY, OFFLOADING), each slot held by a copy (busy + 1; with `touch`,
   hits + 1 up to 255) and (their slots in order, how many were idle before) returned; else
   None, nothing changed. */
static PyObject *states_hold_keyed(States *st, PyObject *args) {
    PyObject *ids;
    Table *t;
    int touch;
    if (!PyArg_ParseTuple(args, "O!O!p", &PyList_Type, &ids, &TableType, &t, &touch)) return NULL;
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    if (check_held(t) < 0) return NULL;
    if (t->capacity != st->capacity) return PyErr_Format(PyExc_ValueError, "hold_keyed: a key table of another tier");
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *slots = PyList_New(n);
    if (!slots) return NULL;
    const uint8_t *state = (const uint8_t *)st->state.buf;
    PyObject **kids = PySequence_Fast_ITEMS(ids);
    int64_t homes[GROUP];
    for (Py_ssize_t i = 0; i < n; i++) { /* find every slot before changing anything */
        if (i % GROUP == 0 && homes_ahead(t, kids + i, n - i < GROUP ? n - i : GROUP, homes) < 0) goto fail;
        PyObject *kid = kids[i];
        int64_t home = homes[i % GROUP];
        int32_t slot = home == -2 ? EMPTY : probe(t, PyBytes_AS_STRING(kid), (uint64_t)home, NULL);
        if (slot == EMPTY || !READABLE(state[slot])) {
            Py_DECREF(slots);
            Py_RETURN_NONE;
        }
        PyObject *num = PyLong_FromLong(slot);
        if (!num) goto fail;
        PyList_SET_ITEM(slots, i, num);
    }
    int32_t *busy = (int32_t *)st->busy.buf;
    uint8_t *hits = (uint8_t *)st->hits.buf;
    Py_ssize_t idle = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long slot = PyLong_AsLong(PyList_GET_ITEM(slots, i));
        if (!busy[slot]) idle++;
        busy[slot]++;
        if (touch && hits[slot] < 255) hits[slot]++;
    }
    return Py_BuildValue("(Nn)", slots, idle);
fail:
    Py_DECREF(slots);
    return NULL;
}

/* touch(slots) -> None: hits + 1 of each slot, in order, up to 255 (TierIndex.touch_all). */
static PyObject *states_touch(States *st, PyObject *obj) {
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    uint8_t *hits = (uint8_t *)st->hits.buf;
    for (Py_ssize_t i = 0; i < arg.n; i++) {
        if (i % GROUP == 0) {
            Py_ssize_t end = arg.n - i < GROUP ? arg.n : i + GROUP;
            for (Py_ssize_t j = i; j < end; j++) PREFETCH(hits + arg.at[j]);
        }
        if (hits[arg.at[i]] < 255) hits[arg.at[i]]++;
    }
    slots_release(&arg);
    Py_RETURN_NONE;
}

/* idle(slots) -> list: the slots of `slots` no copy is using (busy 0), in order. */
static PyObject *states_idle(States *st, PyObject *obj) {
    if (!st->held) return PyErr_Format(PyExc_ValueError, "States: not initialised");
    Slots arg;
    if (slots_arg(obj, st->capacity, &arg) < 0) return NULL;
    const int32_t *busy = (const int32_t *)st->busy.buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < arg.n; i++) k += !busy[arg.at[i]];
    PyObject *out = PyList_New(k);
    if (!out) goto done;
    for (Py_ssize_t i = 0, j = 0; i < arg.n; i++) {
        if (busy[arg.at[i]]) continue;
        PyObject *num = PyLong_FromLongLong(arg.at[i]);
        if (!num) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, j++, num);
    }
done:
    slots_release(&arg);
    return out;
}

static PyMethodDef states_methods[] = {
    {"reuse", (PyCFunction)states_reuse, METH_VARARGS, "reuse(slots, new, busy_delta) -> None or (left, undirty)"},
    {"mark", (PyCFunction)states_mark, METH_VARARGS, "mark(slots, state, busy, pins)"},
    {"commit", (PyCFunction)states_commit, METH_VARARGS,
     "commit(slots, ids, table, host_table, host_states) -> None or (dirty, absent_slots, absent_ids, keyed, clean)"},
    {"set", (PyCFunction)states_set, METH_VARARGS, "set(slots, new, busy_delta) -> None or the changes to apply"},
    {"hold", (PyCFunction)states_hold, METH_VARARGS, "hold(slots, touch) -> slots idle before"},
    {"touch", (PyCFunction)states_touch, METH_O, "touch(slots): hits + 1 of each, up to 255"},
    {"idle", (PyCFunction)states_idle, METH_O, "idle(slots) -> the slots no copy is using, in order"},
    {"hold_keyed", (PyCFunction)states_hold_keyed, METH_VARARGS, "hold_keyed(ids, table, touch) -> None or (slots, idle)"},
    {"unhold", (PyCFunction)states_unhold, METH_O, "unhold(slots) -> None or (adds, idle)"},
    {"unpin", (PyCFunction)states_unpin, METH_O, "unpin(slots) -> None or (adds, idle_filling, unheld)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StatesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_kvtier_host.States",
    .tp_basicsize = sizeof(States),
    .tp_dealloc = (destructor)states_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The page states of one TierIndex's arrays.",
    .tp_methods = states_methods,
    .tp_init = (initproc)states_init,
    .tp_new = PyType_GenericNew,
};

/* Each of `slots` to the end in order (moved there if listed; with `listed_only`, the slots not
   listed left out), its stamp `stamp`, `stamp` + 1, ...; how many were newly listed (or, with
   `listed_only`, moved). A group's links are fetched ahead: the slots of a large tier lie far
   apart. */
static PyObject *links_to_end(Links *l, PyObject *args, int listed_only) {
    PyObject *obj;
    long long now;
    if (!PyArg_ParseTuple(args, "OL", &obj, &now)) return NULL;
    if (!l->held) return PyErr_Format(PyExc_ValueError, "Links: not initialised");
    Slots arg;
    if (slots_arg(obj, l->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    int32_t *nxt = (int32_t *)l->next.buf, *prv = (int32_t *)l->prev.buf;
    uint8_t *member = (uint8_t *)l->member.buf;
    int64_t *stamp = (int64_t *)l->stamp.buf;
    int32_t head = (int32_t)l->capacity;
    Py_ssize_t counted = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % GROUP == 0) {
            Py_ssize_t end = n - i < GROUP ? n : i + GROUP;
            for (Py_ssize_t j = i; j < end; j++) {
                PREFETCH(member + slots[j]);
                PREFETCH(nxt + slots[j]);
                PREFETCH(prv + slots[j]);
            }
        }
        int32_t slot = (int32_t)slots[i];
        if (member[slot]) {
            int32_t p = prv[slot], q = nxt[slot];
            nxt[p] = q;
            prv[q] = p;
            counted += listed_only;
        } else if (listed_only) {
            continue;
        } else {
            member[slot] = 1;
            counted++;
        }
        stamp[slot] = now++;
        int32_t last = prv[head];
        nxt[last] = slot;
        prv[slot] = last;
        nxt[slot] = head;
        prv[head] = slot;
    }
    slots_release(&arg);
    return PyLong_FromSsize_t(counted);
}

/* append(slots, stamp) -> int: each slot to the end in order (moved there if listed), its stamp
   `stamp`, `stamp` + 1, ...; how many were not listed before. */
static PyObject *links_append(Links *l, PyObject *args) { return links_to_end(l, args, 0); }

/* touch(slots, stamp) -> int: each slot listed now moved to the end in order (the others left
   out), stamped as `append` does; how many moved (LRUPolicy.touch_many). */
static PyObject *links_touch(Links *l, PyObject *args) { return links_to_end(l, args, 1); }

/* discard(slots) -> int: the listed ones leave (the order of the rest stays); how many left. */
static PyObject *links_discard(Links *l, PyObject *obj) {
    if (!l->held) return PyErr_Format(PyExc_ValueError, "Links: not initialised");
    Slots arg;
    if (slots_arg(obj, l->capacity, &arg) < 0) return NULL;
    const int64_t *slots = arg.at;
    Py_ssize_t n = arg.n;
    int32_t *nxt = (int32_t *)l->next.buf, *prv = (int32_t *)l->prev.buf;
    uint8_t *member = (uint8_t *)l->member.buf;
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t slot = (int32_t)slots[i];
        if (member[slot]) {
            int32_t p = prv[slot], q = nxt[slot];
            nxt[p] = q;
            prv[q] = p;
            member[slot] = 0;
            gone++;
        }
    }
    slots_release(&arg);
    return PyLong_FromSsize_t(gone);
}

/* first(n) -> list: up to n slots from the front, in order. */
static PyObject *links_first(Links *l, PyObject *arg) {
    if (!l->held) return PyErr_Format(PyExc_ValueError, "Links: not initialised");
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    const int32_t *nxt = (const int32_t *)l->next.buf;
    int32_t head = (int32_t)l->capacity;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int32_t slot = nxt[head];
    for (Py_ssize_t i = 0; i < n && slot != head; i++) {
        PyObject *num = PyLong_FromLong(slot);
        if (!num || PyList_Append(out, num) < 0) {
            Py_XDECREF(num);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(num);
        slot = nxt[slot];
    }
    return out;
}

static PyMethodDef links_methods[] = {
    {"append", (PyCFunction)links_append, METH_VARARGS, "append(slots, stamp) -> slots newly listed"},
    {"touch", (PyCFunction)links_touch, METH_VARARGS, "touch(slots, stamp) -> listed slots moved to the end"},
    {"discard", (PyCFunction)links_discard, METH_O, "discard(slots) -> slots that left"},
    {"first", (PyCFunction)links_first, METH_O, "first(n) -> up to n slots from the front"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LinksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_kvtier_host.Links",
    .tp_basicsize = sizeof(Links),
    .tp_dealloc = (destructor)links_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The links of one SlotList's buffers.",
    .tp_methods = links_methods,
    .tp_init = (initproc)links_init,
    .tp_new = PyType_GenericNew,
};

/* set_where(numbers, slots, value, when) -> None: numbers[slot] = value for each of `slots`
   (in range of the writable int64 buffer `numbers`) whose number is `when`, or every one when
   `when` is negative (kvtier.pool.landing's marks and clears). */
static PyObject *set_where(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *buf, *obj;
    long long value, when;
    if (!PyArg_ParseTuple(args, "OOLL", &buf, &obj, &value, &when)) return NULL;
    Py_buffer view;
    if (writable(buf, &view, 8, "numbers") < 0) return NULL;
    Slots arg;
    if (slots_arg(obj, view.len / 8, &arg) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t *numbers = (int64_t *)view.buf;
    for (Py_ssize_t i = 0; i < arg.n; i++)
        if (when < 0 || numbers[arg.at[i]] == when) numbers[arg.at[i]] = value;
    slots_release(&arg);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS, "fill(keys, out, young, old, max_key, room, chars_room) -> characters cached, or None"},
    {"set_where", set_where, METH_VARARGS, "set_where(numbers, slots, value, when): numbers[slot] = value where it is `when` (or always, when < 0)"},
    {"known", known, METH_VARARGS, "known(keys, young) -> None or (ids with None where young has none, how many)"},
    {"lanes", lanes, METH_O, "lanes(avx2) -> whether fill's four-lane digests run on AVX2 now (for the tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvtier_host", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvtier_host(void) {
    start_state(BYTES_STATE, "kvtier-key-bytes");
    start_state(STR_STATE, "kvtier-key-str");
    choose_digest4();
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&LinksType) < 0 || PyType_Ready(&StatesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StatesType);
    if (PyModule_AddObject(m, "States", (PyObject *)&StatesType) < 0) {
        Py_DECREF(&StatesType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LinksType);
    if (PyModule_AddObject(m, "Links", (PyObject *)&LinksType) < 0) {
        Py_DECREF(&LinksType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

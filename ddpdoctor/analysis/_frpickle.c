/* A reader of Flight Recorder pickles that builds only what the converter reads (frnative.py).
 *
 * Why: converting a 2,000-entry dump spent half its instructions in pickle's C unpickler building
 * (and then freeing) ~100,000 objects, most of them never read (thread names, timeouts, op ids,
 * the start times...), and a third of the rest reading the entries' fields back out of their
 * dicts and pickling the fields that make an entry's *kind* into a cache key.
 *
 * This reader runs the same opcode machine as pickle's unpickler over a small subset of opcodes
 * (the plain-data ones protocols 2-5 write: dicts, lists, tuples, str, bytes, int, float, bool,
 * None, the memo, MARK, FRAME, PROTO, STOP) into a table of nodes that point into the bytes, with
 * no Python object made. Anything else, GLOBAL and every opcode that can reach a callable
 * included, or any input the real unpickler would reject, or anything this reader is not sure
 * about, makes it answer None: the caller then reads the file with the restricted Python
 * unpickler (frdump.read), which decides (refuses, skips or reads). So this code never decides
 * that a file is safe or hostile; it only accepts the plain subset and gives what the Python
 * path would read from it. Every read is bounds-checked; the work is linear in the input (the
 * encoded keys have a budget proportional to the input; over it: None).
 *
 * Then only the entries' fields the converter reads are made into objects: per entry a row of its
 * position and times and the index of its (kind, stack) pair: its *kind* groups entries whose 9
 * kind fields are equal values of equal types (an exact encoding: 1, True and 1.0 differ, so do a
 * list and a tuple), its stack entries whose frames lists hold the same frame objects (or equal
 * non-list values); the kind fields and the frames are made once, for the first entry of each.
 * The work is linear also with crafted keys: hash probes stop at MAXPROBE (then None).
 *
 * Optional (setup.py, optional=True); without it, or with DDPDOCTOR_NATIVE=0: frdump.read. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { T_NONE, T_TRUE, T_FALSE, T_INT, T_FLOAT, T_STR, T_BYTES, T_LIST, T_DICT, T_TUPLE };

#define NIL UINT32_MAX
#define NFIELDS 17   /* the fields frnative.FIELDS names, in its order */
#define NKEYED 9     /* fields 0..8: the kind */
#define F_FRAMES 13  /* the stack */
#define F_RID 16     /* record_id: required, an int */
#define MAXDEPTH 64

typedef struct {           /* 24 bytes: a 2,000-entry dump makes ~35,000 of them */
    uint8_t t;
    uint8_t hashable;
    uint32_t first;        /* list, dict: first segment (NIL: none); tuple: start in kids;
                              str, bytes, float: offset in the data (inputs are < 4 GiB) */
    uint32_t last;         /* list, dict: last segment */
    uint64_t v;            /* int: value; str, bytes: length; list, dict, tuple: item count */
} Node;

typedef struct {
    uint32_t start, count, next;  /* a run of kids (dict: keys and values alternating) */
} Seg;

/* Distinct keys (kinds, stacks) -> their index: open addressing over the keys' bytes, kept in an
 * arena. The hash is not keyed, so a probe longer than MAXPROBE (never seen with real keys at half
 * load) gives the dump to the Python path instead of letting crafted collisions cost quadratic time. */
typedef struct {
    uint64_t h;
    size_t off, len;  /* the key's bytes in the arena */
} Slot;

typedef struct {
    Slot *slots;  /* cap entries, len 0: empty; an entry's index is its order of insertion */
    size_t cap, n;
    unsigned char *arena;
    size_t na, ca;
    uint32_t *idx;  /* index of each slot */
} Table;

#define MAXPROBE 64

typedef struct {
    const unsigned char *d;
    size_t len;
    Node *nodes;
    size_t nn, cn;
    Seg *segs;
    size_t ns, cs;
    uint32_t *kids;
    size_t nk, ck;
    uint32_t *stack;
    size_t nst, cst;
    size_t *marks;
    size_t nm, cm;
    uint32_t *memo;
    size_t memo_size, memo_len;
    PyObject **cache;   /* made objects, by node */
    uint8_t *state;     /* 0 not made, 1 being made (a cycle: refused), 2 made */
    int8_t *slot;       /* a str node's field index + 1 as an entry key, -1 not a field, 0 unknown */
    unsigned char *buf; /* an encoded key */
    size_t nb, cb;
    size_t budget;      /* bytes all encoded keys may still take */
    Table kinds, stacks, pairs;
} R;

static int
grow(void **p, size_t *cap, size_t need, size_t item)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) {
        if (c > ((size_t)1 << 40) / item)
            return -1;
        c *= 2;
    }
    void *q = PyMem_Realloc(*p, c * item);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* the capacity check inline (it runs for nearly every opcode), the growing out of line */
#define GROW(r, arr, n, cap, need) \
    ((need) <= (r)->cap ? 0 : grow((void **)&(r)->arr, &(r)->cap, (need), sizeof(*(r)->arr)))

static inline int64_t
new_node(R *r, uint8_t t)
{
    if (r->nn >= NIL - 1 || GROW(r, nodes, r->nn, cn, r->nn + 1) < 0)
        return -1;
    Node *n = &r->nodes[r->nn];
    memset(n, 0, sizeof(*n));
    n->t = t;
    n->hashable = t != T_LIST && t != T_DICT;
    n->first = n->last = NIL;
    return (int64_t)r->nn++;
}

static int
push(R *r, uint32_t id)
{
    if (GROW(r, stack, r->nst, cst, r->nst + 1) < 0)
        return -1;
    r->stack[r->nst++] = id;
    return 0;
}

static size_t
fence(R *r)
{
    return r->nm ? r->marks[r->nm - 1] : 0;
}

/* Appends stack[x:] to the list or dict at stack[x - 1] as one segment and truncates the stack to x. */
static int
extend(R *r, size_t x, uint8_t want)
{
    size_t len = r->nst;
    if (x > len || x <= fence(r))
        return -1;
    if (len == x)
        return 0;  /* the unpickler does nothing here, whatever the target */
    Node *tgt = &r->nodes[r->stack[x - 1]];
    if (tgt->t != want)
        return -1;
    size_t cnt = len - x;
    if (want == T_DICT) {
        if (cnt % 2)
            return -1;
        for (size_t i = x; i < len; i += 2)
            if (!r->nodes[r->stack[i]].hashable)
                return -1;  /* unhashable key: the unpickler raises TypeError */
    }
    if (r->nk + cnt >= NIL || r->ns + 1 >= NIL || GROW(r, kids, r->nk, ck, r->nk + cnt) < 0
            || GROW(r, segs, r->ns, cs, r->ns + 1) < 0)
        return -1;
    tgt = &r->nodes[r->stack[x - 1]];
    memcpy(r->kids + r->nk, r->stack + x, cnt * sizeof(uint32_t));
    Seg *s = &r->segs[r->ns];
    s->start = (uint32_t)r->nk;
    s->count = (uint32_t)cnt;
    s->next = NIL;
    if (tgt->last == NIL)
        tgt->first = (uint32_t)r->ns;
    else
        r->segs[tgt->last].next = (uint32_t)r->ns;
    tgt->last = (uint32_t)r->ns;
    tgt->v += want == T_DICT ? cnt / 2 : cnt;
    r->ns++;
    r->nk += cnt;
    r->nst = x;
    return 0;
}

static int
make_tuple(R *r, size_t start)
{
    size_t cnt = r->nst - start;
    if (r->nk + cnt >= NIL || GROW(r, kids, r->nk, ck, r->nk + cnt) < 0)
        return -1;
    int64_t id = new_node(r, T_TUPLE);
    if (id < 0)
        return -1;
    Node *n = &r->nodes[id];
    n->first = (uint32_t)r->nk;
    n->v = cnt;
    for (size_t i = start; i < r->nst; i++)
        n->hashable &= r->nodes[r->stack[i]].hashable;
    if (cnt)  /* an empty tuple may come before any array is allocated */
        memcpy(r->kids + r->nk, r->stack + start, cnt * sizeof(uint32_t));
    r->nk += cnt;
    r->nst = start;
    return push(r, (uint32_t)id);
}

static int
memo_put(R *r, size_t idx)
{
    if (r->nst <= fence(r) || idx >= r->len)  /* no legitimate pickle has more memo slots than bytes */
        return -1;
    if (idx >= r->memo_size) {
        size_t old = r->memo_size;
        size_t want = idx + 1 > 2 * old ? idx + 1 : 2 * old;
        if (GROW(r, memo, old, memo_size, want) < 0)
            return -1;
        for (size_t i = old; i < r->memo_size; i++)
            r->memo[i] = NIL;
    }
    if (r->memo[idx] == NIL)
        r->memo_len++;
    r->memo[idx] = r->stack[r->nst - 1];
    return 0;
}

static uint64_t
le(const unsigned char *p, int n)
{
    uint64_t x = 0;
    for (int i = n - 1; i >= 0; i--)
        x = (x << 8) | p[i];
    return x;
}

static inline uint32_t
le4(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Whether the bytes decode as the unpickler decodes str (UTF-8, "surrogatepass"). */
static int
valid_text(const unsigned char *p, size_t n)
{
    unsigned char hi = 0;
    for (size_t i = 0; i < n; i++)
        hi |= p[i];
    if (hi < 0x80)
        return 1;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)n, "surrogatepass");
    if (s == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(s);
    return 1;
}

#define NEED(k) do { if (r->len - pos < (size_t)(k)) return -1; } while (0)

/* Runs the opcodes; the result's node id in *out. -1: not in the subset, or not a valid pickle. */
static int
parse(R *r, uint32_t *out)
{
    const unsigned char *d = r->d;
    size_t pos = 0;
    /* None, True and False: one node each (nodes 0, 1, 2), as they are one object each */
    for (uint8_t t = T_NONE; t <= T_FALSE; t++)
        if (new_node(r, t) != t)
            return -1;
    size_t fend = 0;  /* end of the current FRAME */
    for (;;) {
        size_t start = pos;
        NEED(1);
        unsigned char op = d[pos++];
        int64_t id;
        size_t n;
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1);
            if (d[pos++] > 5)
                return -1;
            break;
        case 0x95: /* FRAME */
            if (start < fend)
                return -1;  /* a frame inside a frame: never written */
            NEED(8);
            n = (size_t)le(d + pos, 8);
            pos += 8;
            NEED(n);
            fend = pos + n;
            break;
        case '.': /* STOP */
            if (r->nst <= fence(r))
                return -1;
            *out = r->stack[r->nst - 1];
            return 0;
        case '(': /* MARK */
            if (GROW(r, marks, r->nm, cm, r->nm + 1) < 0)
                return -1;
            r->marks[r->nm++] = r->nst;
            break;
        case 'N': case 0x88: case 0x89: /* NONE, NEWTRUE, NEWFALSE */
            if (push(r, op == 'N' ? T_NONE : op == 0x88 ? T_TRUE : T_FALSE) < 0)
                return -1;
            break;
        case 'K': case 'M': case 'J': case 0x8a: { /* BININT1, BININT2, BININT, LONG1 */
            int64_t v;
            if (op == 'K') {
                NEED(1);
                v = d[pos++];
            } else if (op == 'M') {
                NEED(2);
                v = (int64_t)le(d + pos, 2);
                pos += 2;
            } else if (op == 'J') {
                NEED(4);
                v = (int32_t)le4(d + pos);
                pos += 4;
            } else {
                NEED(1);
                n = d[pos++];
                if (n > 8)
                    return -1;  /* beyond int64: left to the Python path */
                NEED(n);
                uint64_t u = le(d + pos, (int)n);
                if (n && n < 8 && (d[pos + n - 1] & 0x80))
                    u |= ~(uint64_t)0 << (8 * n);  /* two's complement, sign-extended */
                v = (int64_t)u;
                pos += n;
            }
            id = new_node(r, T_INT);
            if (id < 0)
                return -1;
            r->nodes[id].v = (uint64_t)v;
            if (push(r, (uint32_t)id) < 0)
                return -1;
            break;
        }
        case 'G': /* BINFLOAT */
            NEED(8);
            id = new_node(r, T_FLOAT);
            if (id < 0)
                return -1;
            r->nodes[id].first = (uint32_t)pos;
            pos += 8;
            if (push(r, (uint32_t)id) < 0)
                return -1;
            break;
        case 'X': case 0x8c: case 0x8d: /* BINUNICODE, SHORT_BINUNICODE, BINUNICODE8 */
        case 'B': case 'C': case 0x8e: { /* BINBYTES, SHORT_BINBYTES, BINBYTES8 */
            int w = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
            NEED(w);
            n = w == 1 ? d[pos] : w == 4 ? le4(d + pos) : (size_t)le(d + pos, w);
            pos += w;
            NEED(n);
            int text = op == 'X' || op == 0x8c || op == 0x8d;
            if (text && !valid_text(d + pos, n))
                return -1;
            id = new_node(r, text ? T_STR : T_BYTES);
            if (id < 0)
                return -1;
            r->nodes[id].first = (uint32_t)pos;
            r->nodes[id].v = n;
            pos += n;
            if (push(r, (uint32_t)id) < 0)
                return -1;
            break;
        }
        case '}': case ']': /* EMPTY_DICT, EMPTY_LIST */
            id = new_node(r, op == '}' ? T_DICT : T_LIST);
            if (id < 0 || push(r, (uint32_t)id) < 0)
                return -1;
            break;
        case ')': /* EMPTY_TUPLE */
            if (make_tuple(r, r->nst) < 0)
                return -1;
            break;
        case 0x85: case 0x86: case 0x87: /* TUPLE1, TUPLE2, TUPLE3 */
            n = (size_t)(op - 0x84);
            if (r->nst < n || r->nst - n < fence(r) || make_tuple(r, r->nst - n) < 0)
                return -1;
            break;
        case 't': case 'e': case 'u': { /* TUPLE, APPENDS, SETITEMS: from the last MARK */
            if (r->nm == 0)
                return -1;
            size_t m = r->marks[--r->nm];
            if (m > r->nst)
                return -1;
            if (op == 't') {
                if (make_tuple(r, m) < 0)
                    return -1;
            } else if (extend(r, m, op == 'e' ? T_LIST : T_DICT) < 0) {
                return -1;
            }
            break;
        }
        case 'a': /* APPEND */
            if (r->nst < 1 || r->nst - 1 <= fence(r) || extend(r, r->nst - 1, T_LIST) < 0)
                return -1;
            break;
        case 's': /* SETITEM */
            if (r->nst < 2 || extend(r, r->nst - 2, T_DICT) < 0)
                return -1;
            break;
        case 'q': case 'r': /* BINPUT, LONG_BINPUT */
            n = op == 'q' ? 1 : 4;
            NEED(n);
            if (memo_put(r, op == 'q' ? d[pos] : le4(d + pos)) < 0)
                return -1;
            pos += n;
            break;
        case 0x94: /* MEMOIZE */
            if (memo_put(r, r->memo_len) < 0)
                return -1;
            break;
        case 'h': case 'j': { /* BINGET, LONG_BINGET */
            n = op == 'h' ? 1 : 4;
            NEED(n);
            size_t idx = op == 'h' ? d[pos] : le4(d + pos);
            pos += n;
            if (idx >= r->memo_size || r->memo[idx] == NIL || push(r, r->memo[idx]) < 0)
                return -1;
            break;
        }
        default: /* everything else, every opcode that names or calls a global included */
            return -1;
        }
        /* the unpickler reads a frame into its buffer and an opcode that runs past the frame's end
         * from the file again, skipping the frame's rest: not a plain read, so not read here */
        if (start < fend && pos > fend)
            return -1;
    }
}

static PyObject *make(R *r, uint32_t id, int depth);

/* The Python object of a node, made once (shared nodes give one object, as the memo does). */
static PyObject *
make(R *r, uint32_t id, int depth)
{
    if (r->state[id] == 2) {
        Py_INCREF(r->cache[id]);
        return r->cache[id];
    }
    if (r->state[id] == 1 || depth > MAXDEPTH)
        return NULL;  /* a cycle, or absurd nesting: left to the Python path */
    Node *n = &r->nodes[id];
    const char *p = (const char *)r->d + n->first;
    PyObject *o = NULL;
    r->state[id] = 1;
    switch (n->t) {
    case T_NONE: o = Py_NewRef(Py_None); break;
    case T_TRUE: o = Py_NewRef(Py_True); break;
    case T_FALSE: o = Py_NewRef(Py_False); break;
    case T_INT: o = PyLong_FromLongLong((long long)(int64_t)n->v); break;
    case T_FLOAT: {
        double x = PyFloat_Unpack8(p, 0);
        o = (x == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(x);
        break;
    }
    case T_STR: o = PyUnicode_DecodeUTF8(p, (Py_ssize_t)n->v, "surrogatepass"); break;
    case T_BYTES: o = PyBytes_FromStringAndSize(p, (Py_ssize_t)n->v); break;
    case T_TUPLE:
        o = PyTuple_New((Py_ssize_t)n->v);
        for (uint64_t i = 0; o != NULL && i < n->v; i++) {
            PyObject *c = make(r, r->kids[n->first + i], depth + 1);
            if (c == NULL)
                Py_CLEAR(o);
            else
                PyTuple_SET_ITEM(o, (Py_ssize_t)i, c);
        }
        break;
    case T_LIST: {
        o = PyList_New((Py_ssize_t)n->v);
        Py_ssize_t k = 0;
        for (uint32_t s = n->first; o != NULL && s != NIL; s = r->segs[s].next)
            for (uint32_t i = 0; o != NULL && i < r->segs[s].count; i++) {
                PyObject *c = make(r, r->kids[r->segs[s].start + i], depth + 1);
                if (c == NULL)
                    Py_CLEAR(o);
                else
                    PyList_SET_ITEM(o, k++, c);
            }
        break;
    }
    case T_DICT:
        o = PyDict_New();
        for (uint32_t s = n->first; o != NULL && s != NIL; s = r->segs[s].next)
            for (uint32_t i = 0; o != NULL && i < r->segs[s].count; i += 2) {
                PyObject *k = make(r, r->kids[r->segs[s].start + i], depth + 1);
                PyObject *v = k ? make(r, r->kids[r->segs[s].start + i + 1], depth + 1) : NULL;
                if (v == NULL || PyDict_SetItem(o, k, v) < 0)
                    Py_CLEAR(o);
                Py_XDECREF(k);
                Py_XDECREF(v);
            }
        break;
    }
    if (o == NULL) {
        PyErr_Clear();
        r->state[id] = 0;
        return NULL;
    }
    r->cache[id] = o;
    r->state[id] = 2;
    Py_INCREF(o);
    return o;
}

static inline int
put(R *r, const void *p, size_t n)
{
    if (n > r->budget || GROW(r, buf, r->nb, cb, r->nb + n) < 0)
        return -1;
    r->budget -= n;
    memcpy(r->buf + r->nb, p, n);
    r->nb += n;
    return 0;
}

static int
put_head(R *r, char tag, uint64_t x)
{
    unsigned char h[9];
    h[0] = (unsigned char)tag;
    memcpy(h + 1, &x, 8);
    return put(r, h, 9);
}

/* An exact encoding of a node's value: a tag for each type, lengths before contents (prefix-free),
 * so equal bytes mean equal values of equal types. A dict's items are written as the pickle
 * set them (order and repeats): equal bytes, equal dicts; unequal bytes, at worst one kind more. */
static int
encode(R *r, uint32_t id, int depth)
{
    Node *n = &r->nodes[id];
    if (depth > MAXDEPTH)
        return -1;
    switch (n->t) {
    case T_NONE: return put(r, "N", 1);
    case T_TRUE: return put(r, "T", 1);
    case T_FALSE: return put(r, "F", 1);
    case T_INT: return put_head(r, 'I', n->v);
    case T_FLOAT: return put(r, "D", 1) < 0 ? -1 : put(r, r->d + n->first, 8);
    case T_STR: case T_BYTES:
        return put_head(r, n->t == T_STR ? 'S' : 'B', n->v) < 0 ? -1 : put(r, r->d + n->first, (size_t)n->v);
    case T_TUPLE:
        if (put_head(r, 'U', n->v) < 0)
            return -1;
        for (uint64_t i = 0; i < n->v; i++)
            if (encode(r, r->kids[n->first + i], depth + 1) < 0)
                return -1;
        return 0;
    default: /* list, dict */
        if (put_head(r, n->t == T_LIST ? 'L' : 'M', n->v) < 0)
            return -1;
        for (uint32_t s = n->first; s != NIL; s = r->segs[s].next)
            for (uint32_t i = 0; i < r->segs[s].count; i++)
                if (encode(r, r->kids[r->segs[s].start + i], depth + 1) < 0)
                    return -1;
        return 0;
    }
}

static uint64_t
hash_bytes(const unsigned char *p, size_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15u ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdu;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, n - i);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53u;
    return h ^ (h >> 29);
}

static int
table_grow(Table *t)
{
    size_t cap = t->cap ? t->cap * 2 : 64;
    Slot *slots = PyMem_Calloc(cap, sizeof(Slot));
    uint32_t *idx = PyMem_Calloc(cap, sizeof(uint32_t));
    if (slots == NULL || idx == NULL) {
        PyMem_Free(slots);
        PyMem_Free(idx);
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++) {
        if (t->slots[i].len == 0)
            continue;
        size_t j = (size_t)t->slots[i].h & (cap - 1);
        while (slots[j].len)
            j = (j + 1) & (cap - 1);
        slots[j] = t->slots[i];
        idx[j] = t->idx[i];
    }
    PyMem_Free(t->slots);
    PyMem_Free(t->idx);
    t->slots = slots;
    t->idx = idx;
    t->cap = cap;
    return 0;
}

/* The index of the current key (r->buf, never empty: it starts with a tag) in t, a new one
 * (the count so far) when unseen; -1: out of memory or a probe too long. */
static int64_t
intern_key(R *r, Table *t, int *fresh)
{
    if (2 * (t->n + 1) > t->cap && table_grow(t) < 0)
        return -1;
    uint64_t h = hash_bytes(r->buf, r->nb);
    size_t j = (size_t)h & (t->cap - 1);
    for (int probe = 0; t->slots[j].len; probe++) {
        Slot *sl = &t->slots[j];
        if (sl->h == h && sl->len == r->nb && memcmp(t->arena + sl->off, r->buf, r->nb) == 0) {
            *fresh = 0;
            return t->idx[j];
        }
        if (probe >= MAXPROBE)
            return -1;
        j = (j + 1) & (t->cap - 1);
    }
    if (t->n >= NIL || grow((void **)&t->arena, &t->ca, t->na + r->nb, 1) < 0)
        return -1;
    memcpy(t->arena + t->na, r->buf, r->nb);
    t->slots[j].h = h;
    t->slots[j].off = t->na;
    t->slots[j].len = r->nb;
    t->idx[j] = (uint32_t)t->n;
    t->na += r->nb;
    *fresh = 1;
    return (int64_t)t->n++;
}

static int
is_str(R *r, uint32_t id, const char *s, size_t n)
{
    Node *k = &r->nodes[id];
    return k->t == T_STR && k->v == n && memcmp(r->d + k->first, s, n) == 0;
}

/* A field's value: its node made, or the default (a new reference; NULL: failed). */
static PyObject *
field(R *r, const uint32_t *f, int i, PyObject *defaults)
{
    if (f[i] == NIL)
        return Py_NewRef(PyTuple_GET_ITEM(defaults, i));
    return make(r, f[i], 1);
}

typedef struct {
    const char *s[NFIELDS];
    Py_ssize_t n[NFIELDS];
} Names;

/* One entry (a dict node): its row appended to rows, and its kind's and stack's first values. */
static int
entry(R *r, uint32_t id, const Names *nm, PyObject *defaults, PyObject *required, PyObject **out,
      int64_t *last_rid, int *ordered)
{
    PyObject *rows = out[0], *kinds = out[1], *stacks = out[2], *pairs = out[3];
    uint32_t f[NFIELDS];
    for (int i = 0; i < NFIELDS; i++)
        f[i] = NIL;
    Node *e = &r->nodes[id];
    for (uint32_t s = e->first; s != NIL; s = r->segs[s].next)
        for (uint32_t i = 0; i < r->segs[s].count; i += 2) {
            uint32_t k = r->kids[r->segs[s].start + i];
            if (r->nodes[k].t != T_STR)
                return -1;  /* only str keys in entries (else: the Python path) */
            int8_t sl = r->slot[k];
            if (sl == 0) {
                sl = -1;
                for (int j = 0; j < NFIELDS; j++)
                    if (is_str(r, k, nm->s[j], (size_t)nm->n[j])) {
                        sl = (int8_t)(j + 1);
                        break;
                    }
                r->slot[k] = sl;
            }
            if (sl > 0)
                f[sl - 1] = r->kids[r->segs[s].start + i + 1];  /* a repeated key: the last wins */
        }
    for (int i = 0; i < NFIELDS; i++)
        if (f[i] == NIL && PyTuple_GET_ITEM(defaults, i) == required)
            return -1;
    if (f[F_RID] == NIL || r->nodes[f[F_RID]].t != T_INT)
        return -1;
    int64_t rid = (int64_t)r->nodes[f[F_RID]].v;
    if (rid < *last_rid)
        *ordered = 0;
    *last_rid = rid;
    int fresh;
    r->nb = 0;
    for (int i = 0; i < NKEYED; i++)
        if (f[i] == NIL ? put(r, "m", 1) < 0 : encode(r, f[i], 0) < 0)
            return -1;
    int64_t ki = intern_key(r, &r->kinds, &fresh);
    if (ki < 0)
        return -1;
    if (fresh) {
        PyObject *t = PyTuple_New(NKEYED);
        for (int i = 0; t != NULL && i < NKEYED; i++) {
            PyObject *v = field(r, f, i, defaults);
            if (v == NULL)
                Py_CLEAR(t);
            else
                PyTuple_SET_ITEM(t, i, v);
        }
        if (t == NULL || PyList_Append(kinds, t) < 0) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    /* the stack: a frames list by the identity of its items (torch's pickles share the frame
     * dicts through the memo), anything else by its value */
    r->nb = 0;
    uint32_t fr = f[F_FRAMES];
    if (fr != NIL && r->nodes[fr].t == T_LIST) {
        if (put(r, "L", 1) < 0)
            return -1;
        for (uint32_t s = r->nodes[fr].first; s != NIL; s = r->segs[s].next)
            if (put(r, r->kids + r->segs[s].start, r->segs[s].count * sizeof(uint32_t)) < 0)
                return -1;
    } else if (put(r, "V", 1) < 0 || (fr == NIL ? put(r, "m", 1) : encode(r, fr, 0)) < 0) {
        return -1;
    }
    int64_t si = intern_key(r, &r->stacks, &fresh);
    if (si < 0)
        return -1;
    if (fresh) {
        PyObject *v = field(r, f, F_FRAMES, defaults);
        if (v == NULL || PyList_Append(stacks, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    /* the (kind, stack) pair: the converter's cache of worked-out kinds is a list by pair index,
     * where a dict keyed by a tuple cost ~5x as much an entry */
    uint32_t kp[2] = {(uint32_t)ki, (uint32_t)si};
    r->nb = 0;
    if (put(r, kp, sizeof(kp)) < 0)
        return -1;
    int64_t pi = intern_key(r, &r->pairs, &fresh);
    if (pi < 0)
        return -1;
    if (fresh) {
        PyObject *t = Py_BuildValue("(LL)", (long long)ki, (long long)si);
        if (t == NULL || PyList_Append(pairs, t) < 0) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    static const int per_row[] = {9, 10, 11, 12, 14, 15, 16};
    PyObject *row = PyTuple_New(8);
    if (row == NULL)
        return -1;
    PyTuple_SET_ITEM(row, 0, PyLong_FromLongLong(pi));
    for (int i = 0; i < 7; i++)
        PyTuple_SET_ITEM(row, 1 + i, field(r, f, per_row[i], defaults));
    for (int i = 0; i < 8; i++)
        if (PyTuple_GET_ITEM(row, i) == NULL) {
            Py_DECREF(row);  /* tuple dealloc skips the NULL items */
            return -1;
        }
    int rc = PyList_Append(rows, row);
    Py_DECREF(row);
    return rc;
}

static void
release(R *r)
{
    if (r->cache != NULL)
        for (size_t i = 0; i < r->nn; i++)
            if (r->state[i] == 2)
                Py_DECREF(r->cache[i]);
    PyMem_Free(r->nodes);
    PyMem_Free(r->segs);
    PyMem_Free(r->kids);
    PyMem_Free(r->stack);
    PyMem_Free(r->marks);
    PyMem_Free(r->memo);
    PyMem_Free(r->cache);
    PyMem_Free(r->state);
    PyMem_Free(r->slot);
    PyMem_Free(r->buf);
    Table *ts[3] = {&r->kinds, &r->stacks, &r->pairs};
    for (int i = 0; i < 3; i++) {
        PyMem_Free(ts[i]->slots);
        PyMem_Free(ts[i]->idx);
        PyMem_Free(ts[i]->arena);
    }
}

/* The dump without its entries, and the entries as rows; NULL (no exception): not read here. */
static PyObject *
read_dump(R *r, const Names *nm, PyObject *defaults, PyObject *required)
{
    uint32_t top;
    if (parse(r, &top) < 0 || r->nodes[top].t != T_DICT)
        return NULL;
    r->cache = PyMem_Calloc(r->nn ? r->nn : 1, sizeof(PyObject *));
    r->state = PyMem_Calloc(r->nn ? r->nn : 1, 1);
    r->slot = PyMem_Calloc(r->nn ? r->nn : 1, 1);
    if (r->cache == NULL || r->state == NULL || r->slot == NULL)
        return NULL;
    r->budget = 64 * r->len + (1 << 20);
    uint32_t entries = NIL;
    PyObject *head = PyDict_New();
    if (head == NULL)
        return NULL;
    Node *t = &r->nodes[top];
    for (uint32_t s = t->first; s != NIL; s = r->segs[s].next)
        for (uint32_t i = 0; i < r->segs[s].count; i += 2) {
            uint32_t k = r->kids[r->segs[s].start + i], v = r->kids[r->segs[s].start + i + 1];
            if (is_str(r, k, "entries", 7)) {
                entries = v;  /* a repeated key: the last wins */
                continue;
            }
            PyObject *ko = make(r, k, 1), *vo = ko ? make(r, v, 1) : NULL;
            int bad = vo == NULL || PyDict_SetItem(head, ko, vo) < 0;
            Py_XDECREF(ko);
            Py_XDECREF(vo);
            if (bad) {
                Py_DECREF(head);
                return NULL;
            }
        }
    if (entries == NIL || r->nodes[entries].t != T_LIST) {
        Py_DECREF(head);
        return NULL;
    }
    PyObject *out[4] = {PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0)};
    int ok = out[0] && out[1] && out[2] && out[3];
    int64_t last_rid = INT64_MIN;
    int ordered = 1;
    for (uint32_t s = r->nodes[entries].first; ok && s != NIL; s = r->segs[s].next)
        for (uint32_t i = 0; ok && i < r->segs[s].count; i++) {
            uint32_t e = r->kids[r->segs[s].start + i];
            if (r->nodes[e].t == T_DICT)  /* what is not a dict is not an entry (as frconvert) */
                ok = entry(r, e, nm, defaults, required, out, &last_rid, &ordered) == 0;
        }
    PyObject *res = ok ? Py_BuildValue("(OOOOOO)", head, out[0], out[1], out[2], out[3], ordered ? Py_True : Py_False)
                       : NULL;
    Py_DECREF(head);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(out[i]);
    return res;
}

static PyObject *
rows(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data;
    PyObject *names, *defaults, *required;
    if (!PyArg_ParseTuple(args, "y*O!O!O", &data, &PyTuple_Type, &names, &PyTuple_Type, &defaults, &required))
        return NULL;
    if (PyTuple_GET_SIZE(names) != NFIELDS || PyTuple_GET_SIZE(defaults) != NFIELDS) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "_frpickle.rows: 17 field names and defaults");
        return NULL;
    }
    Names nm;
    for (int i = 0; i < NFIELDS; i++) {
        nm.s[i] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, i), &nm.n[i]);
        if (nm.s[i] == NULL) {
            PyBuffer_Release(&data);
            return NULL;
        }
    }
    if ((uint64_t)data.len >= NIL) {  /* offsets are 32-bit: left to the Python path */
        PyBuffer_Release(&data);
        Py_RETURN_NONE;
    }
    R r;
    memset(&r, 0, sizeof(r));
    r.d = data.buf;
    r.len = (size_t)data.len;
    PyObject *res = read_dump(&r, &nm, defaults, required);
    release(&r);
    PyBuffer_Release(&data);
    if (res == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return res;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS,
     "rows(data, names, defaults, required) -> (head, rows, kinds, stacks, pairs, ordered) or None: see frnative.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frpickle", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__frpickle(void)
{
    return PyModule_Create(&module);
}

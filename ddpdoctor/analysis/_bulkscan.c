/* The loader's bulk path (analysis/fastscan.py) in C: splits a chunk of whole lines, matches each
 * against the writer's ``c`` layout (the same text rules as fastscan._SCAN), looks its shape up
 * and accounts every line of a known shape into the RankTrace, as fastscan.Bulk does with
 * whole-column Python operations; it stops at the first line the general (json) path must read.
 *
 * Why: the Python bulk path cost ~20k instructions an event (the regex ~7k, the rest ~60 column
 * operations a chunk); reading the rank files is >90% of ``ddpdoctor report`` at scale. Here a
 * line costs a few hundred instructions: one pass over its bytes, a hash of its shape key, two
 * table-driven crc32 updates.
 *
 * Untrusted input: every read is bounded by the line's end, no recursion, one pass a line (the
 * shape table is bounded by the caller's dict: at most fastscan/load._MAX_SHAPES keys). Numbers
 * have at most 18 digits (as the pattern), so they fit an int64 and ts + d cannot overflow.
 *
 * Optional (setup.py, optional=True); without it, or with DDPDOCTOR_NATIVE=0, fastscan.Bulk
 * runs its Python path, which stays the reference (tests/unit/test_bulkscan.py compares them). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIGITS 18
#define MAX_DDP 8
#define QUICK 64

static uint32_t crc_table[8][256];

static void
crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

/* zlib.crc32(data, crc): the same value, chained the same way (slice-by-8). */
static uint32_t
crc32_update(uint32_t crc, const unsigned char *p, Py_ssize_t n)
{
    crc = ~crc;
    while (n >= 8) {
        uint32_t a = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        crc = crc_table[7][a & 0xff] ^ crc_table[6][(a >> 8) & 0xff] ^ crc_table[5][(a >> 16) & 0xff]
              ^ crc_table[4][a >> 24] ^ crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]]
              ^ crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n-- > 0)
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* ------------------------------------------------------------------------------------------ */
/* The layout (fastscan._pattern): {"t":"c","op":OP","g":G","s":N,MID"ts":N,"d":N,"site":-?D[,"step":N]REST}\n */

typedef struct {
    const char *part[4];  /* the shape key: opg, mid, site (with ',"step":' when there is a step), rest */
    Py_ssize_t len[4];
    long long ts, d;
} Match;

static int
lit(const char **pp, const char *end, const char *s, Py_ssize_t n)
{
    if (end - *pp < n || memcmp(*pp, s, (size_t)n) != 0)
        return 0;
    *pp += n;
    return 1;
}

/* (?:0|[1-9][0-9]{0,17}): the digits' length, 0 when none; greedy like the pattern. */
static Py_ssize_t
number(const char *p, const char *end, long long *out)
{
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0') {
        *out = 0;
        return 1;
    }
    long long v = 0;
    Py_ssize_t n = 0;
    while (p + n < end && n < MAX_DIGITS && p[n] >= '0' && p[n] <= '9') {
        v = v * 10 + (p[n] - '0');
        n++;
    }
    *out = v;
    return n;
}

/* [^"\\\n]* */
static const char *
plain_run(const char *p, const char *end)
{
    while (p < end && *p != '"' && *p != '\\' && *p != '\n')
        p++;
    return p;
}

/* The line [p, nl] (nl: its newline) as the pattern reads it; 0 when it is not of the layout. */
static int
match_line(const char *p, const char *nl, Match *m)
{
    const char *end = nl;  /* no part reaches the newline */
    long long unused;
    Py_ssize_t k;
    if (!lit(&p, end, "{\"t\":\"c\",\"op\":\"", 15))
        return 0;
    m->part[0] = p;
    p = plain_run(p, end);
    if (!lit(&p, end, "\",\"g\":\"", 7))
        return 0;
    p = plain_run(p, end);
    m->len[0] = p - m->part[0];
    if (!lit(&p, end, "\",\"s\":", 6) || (k = number(p, end, &unused)) == 0)
        return 0;
    p += k;
    if (!lit(&p, end, ",", 1))
        return 0;
    /* MID: up to the first '"ts":' (every quote inside it is not followed by 'ts":') */
    m->part[1] = p;
    for (;;) {
        const char *q = memchr(p, '"', (size_t)(end - p));
        if (q == NULL)
            return 0;
        if (end - q >= 5 && memcmp(q, "\"ts\":", 5) == 0) {
            p = q;
            break;
        }
        p = q + 1;
    }
    m->len[1] = p - m->part[1];
    p += 5;
    if ((k = number(p, end, &m->ts)) == 0)
        return 0;
    p += k;
    if (!lit(&p, end, ",\"d\":", 5) || (k = number(p, end, &m->d)) == 0)
        return 0;
    p += k;
    if (!lit(&p, end, ",\"site\":", 8))
        return 0;
    m->part[2] = p;
    if (p < end && *p == '-')
        p++;
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    while (p < end && *p >= '0' && *p <= '9')
        p++;
    {
        const char *q = p;
        /* (,"step":N)? : taken only with its number, else the text goes to REST */
        if (lit(&q, end, ",\"step\":", 8) && (k = number(q, end, &unused)) > 0) {
            m->len[2] = q - m->part[2];
            p = q + k;
        }
        else
            m->len[2] = p - m->part[2];
    }
    /* REST: .* then '}\n' */
    if (nl - p < 1 || nl[-1] != '}')
        return 0;
    m->part[3] = p;
    m->len[3] = (nl - 1) - p;
    return 1;
}

/* ------------------------------------------------------------------------------------------ */

typedef struct Group {
    PyObject *gs;        /* GroupStream (strong) */
    PyObject *g;         /* its name (strong) */
    /* loaded while a run() call has taken lines of this group, written back at its end */
    int loaded;
    long long count;
    uint32_t op, sig;
    PyObject *blocks;    /* gs.blocks (strong while loaded) */
    int prev_barrier;    /* the group's latest event is a barrier ... */
    PyObject *prev_site; /* ... at this site (strong while loaded) */
    PyObject *last_opsite;  /* (op, site) of the latest event taken (borrowed from its entry) */
} Group;

typedef struct Entry {
    Py_hash_t hash;
    PyObject *key;       /* tuple of 4 bytes (strong) */
    PyObject *shape;     /* fastscan.Shape, NULL for a shape the bulk path never takes (strong) */
    PyObject *op, *site, *opsite, *op_b, *sig_b;  /* the shape's (strong) */
    Py_ssize_t group;    /* index into Scanner.groups */
    int ddp;             /* index into Scanner.ddp_ops, -1 when not a DDP step */
    int train_fwd, barrier;
    /* the events taken, written to the shape by finish() */
    long long n;
    uint64_t total;
    long long longest;
} Entry;

typedef struct {
    PyObject_HEAD
    PyObject *rt, *shapes, *tail, *last_op, *after, *ddp_steps, *ddp_sites, *barriers, *ddp_ops;
    long long block;
    Py_ssize_t tail_max;
    Entry **table;       /* open addressing by hash, power-of-two size */
    Py_ssize_t cap, used;
    /* a direct-mapped cache in front of the table, by a cheap hash of the key (quick_hash): a hit
     * is verified byte for byte, so a collision only costs the table lookup it saves */
    Entry *quick[QUICK];
    Group *groups;
    Py_ssize_t ngroups, groups_cap;
    long long n, end;    /* events taken, their latest end */
    /* per run() call */
    Py_ssize_t *tail_at; /* ring: starts and lengths of the last tail_max lines taken */
    long long ddp_n[MAX_DDP], train_n;
    Entry *ddp_last[MAX_DDP];
    Py_ssize_t *touched; /* groups loaded in this call */
    Py_ssize_t ntouched;
} Scanner;

static void
entry_free(Entry *e)
{
    Py_XDECREF(e->key);
    Py_XDECREF(e->shape);
    Py_XDECREF(e->op);
    Py_XDECREF(e->site);
    Py_XDECREF(e->opsite);
    Py_XDECREF(e->op_b);
    Py_XDECREF(e->sig_b);
    PyMem_Free(e);
}

static void
Scanner_dealloc(Scanner *self)
{
    for (Py_ssize_t i = 0; i < self->cap; i++)
        if (self->table[i] != NULL)
            entry_free(self->table[i]);
    PyMem_Free(self->table);
    for (Py_ssize_t i = 0; i < self->ngroups; i++) {
        Group *G = &self->groups[i];
        Py_XDECREF(G->gs);
        Py_XDECREF(G->g);
        Py_XDECREF(G->blocks);
        Py_XDECREF(G->prev_site);
    }
    PyMem_Free(self->groups);
    PyMem_Free(self->tail_at);
    PyMem_Free(self->touched);
    Py_XDECREF(self->rt);
    Py_XDECREF(self->shapes);
    Py_XDECREF(self->tail);
    Py_XDECREF(self->last_op);
    Py_XDECREF(self->after);
    Py_XDECREF(self->ddp_steps);
    Py_XDECREF(self->ddp_sites);
    Py_XDECREF(self->barriers);
    Py_XDECREF(self->ddp_ops);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
get_attr(PyObject *rt, const char *name, PyObject **out, PyTypeObject *want)
{
    PyObject *v = PyObject_GetAttrString(rt, name);
    if (v == NULL)
        return -1;
    if (want != NULL && !PyObject_TypeCheck(v, want)) {
        Py_DECREF(v);
        PyErr_Format(PyExc_TypeError, "rt.%s: unexpected type", name);
        return -1;
    }
    *out = v;
    return 0;
}

/* Scanner(rt, shapes, block, barriers, ddp_ops) */
static PyObject *
Scanner_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *rt, *shapes, *barriers, *ddp_ops, *maxlen;
    long long block;
    static char *kw[] = {"rt", "shapes", "block", "barriers", "ddp_ops", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!LOO!", kw, &rt, &PyDict_Type, &shapes, &block,
                                     &barriers, &PyTuple_Type, &ddp_ops))
        return NULL;
    if (block <= 0 || PyTuple_GET_SIZE(ddp_ops) > MAX_DDP) {
        PyErr_SetString(PyExc_ValueError, "block must be positive, at most 8 DDP ops");
        return NULL;
    }
    Scanner *self = (Scanner *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(rt);
    self->rt = rt;
    Py_INCREF(shapes);
    self->shapes = shapes;
    Py_INCREF(barriers);
    self->barriers = barriers;
    Py_INCREF(ddp_ops);
    self->ddp_ops = ddp_ops;
    self->block = block;
    if (get_attr(rt, "tail", &self->tail, NULL) < 0 || get_attr(rt, "last_op", &self->last_op, &PyDict_Type) < 0
        || get_attr(rt, "after_barrier", &self->after, &PyDict_Type) < 0
        || get_attr(rt, "ddp_steps", &self->ddp_steps, &PyDict_Type) < 0
        || get_attr(rt, "ddp_sites", &self->ddp_sites, &PyDict_Type) < 0)
        goto fail;
    maxlen = PyObject_GetAttrString(self->tail, "maxlen");
    if (maxlen == NULL)
        goto fail;
    self->tail_max = PyLong_Check(maxlen) ? PyLong_AsSsize_t(maxlen) : -1;
    Py_DECREF(maxlen);
    if (self->tail_max <= 0 || self->tail_max > 4096) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "rt.tail must be a deque with a maxlen of 1-4096");
        goto fail;
    }
    self->table = PyMem_Calloc(64, sizeof(Entry *));
    self->tail_at = PyMem_Calloc((size_t)self->tail_max * 2, sizeof(Py_ssize_t));
    if (self->table == NULL || self->tail_at == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->cap = 64;  /* only now: the dealloc of a failed new walks cap slots */
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static Py_hash_t
key_hash(const Match *m)
{
    /* the parts one after the other, each with its length: a seeded hash (SipHash), so a file
     * cannot be made of colliding keys */
    Py_uhash_t h = 0x345678u;
    for (int i = 0; i < 4; i++) {
#if PY_VERSION_HEX >= 0x030E0000
        Py_uhash_t x = (Py_uhash_t)Py_HashBuffer(m->part[i], m->len[i]);
#else
        Py_uhash_t x = (Py_uhash_t)_Py_HashBytes(m->part[i], m->len[i]);
#endif
        h = (h ^ x) * 1000003u;
        h ^= (Py_uhash_t)m->len[i];
    }
    return (Py_hash_t)(h == (Py_uhash_t)-1 ? 0 : h);
}

/* The lengths of the key's parts and a few of their bytes (the op and group's first ones): the
 * shapes of one file mostly differ there. Only a cache slot, never trusted (see Scanner.quick). */
static Py_ssize_t
quick_hash(const Match *m)
{
    size_t h = (size_t)m->len[0] * 31u + (size_t)m->len[1] * 7u + (size_t)m->len[2] * 3u + (size_t)m->len[3];
    const unsigned char *op = (const unsigned char *)m->part[0];
    for (Py_ssize_t i = 0; i < 4 && i < m->len[0]; i++)
        h = h * 33u + op[m->len[0] - 1 - i];  /* the group's name ends the first part */
    if (m->len[0] > 0)
        h = h * 33u + op[0];
    return (Py_ssize_t)((h ^ (h >> 7)) & (QUICK - 1));
}

static int
key_equal(PyObject *key, const Match *m)
{
    for (int i = 0; i < 4; i++) {
        PyObject *b = PyTuple_GET_ITEM(key, i);
        if (PyBytes_GET_SIZE(b) != m->len[i] || memcmp(PyBytes_AS_STRING(b), m->part[i], (size_t)m->len[i]) != 0)
            return 0;
    }
    return 1;
}

static Entry *
lookup(Scanner *self, Py_hash_t h, const Match *m)
{
    Py_ssize_t mask = self->cap - 1;
    for (Py_ssize_t i = (Py_ssize_t)((Py_uhash_t)h & (Py_uhash_t)mask);; i = (i + 1) & mask) {
        Entry *e = self->table[i];
        if (e == NULL)
            return NULL;
        if (e->hash == h && key_equal(e->key, m))
            return e;
    }
}

static int
insert(Scanner *self, Entry *e)
{
    if ((self->used + 1) * 2 > self->cap) {
        Py_ssize_t cap = self->cap * 2;
        Entry **t = PyMem_Calloc((size_t)cap, sizeof(Entry *));
        if (t == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < self->cap; i++) {
            Entry *x = self->table[i];
            if (x == NULL)
                continue;
            Py_ssize_t j = (Py_ssize_t)((Py_uhash_t)x->hash & (Py_uhash_t)(cap - 1));
            while (t[j] != NULL)
                j = (j + 1) & (cap - 1);
            t[j] = x;
        }
        PyMem_Free(self->table);
        self->table = t;
        self->cap = cap;
    }
    Py_ssize_t j = (Py_ssize_t)((Py_uhash_t)e->hash & (Py_uhash_t)(self->cap - 1));
    while (self->table[j] != NULL)
        j = (j + 1) & (self->cap - 1);
    self->table[j] = e;
    self->used++;
    return 0;
}

static PyObject *
make_key(const Match *m)
{
    PyObject *key = PyTuple_New(4);
    if (key == NULL)
        return NULL;
    for (int i = 0; i < 4; i++) {
        PyObject *b = PyBytes_FromStringAndSize(m->part[i], m->len[i]);
        if (b == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, b);
    }
    return key;
}

static int
truthy_attr(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static Py_ssize_t
group_of(Scanner *self, PyObject *gs, PyObject *g)
{
    for (Py_ssize_t i = 0; i < self->ngroups; i++)
        if (self->groups[i].gs == gs)
            return i;
    if (self->ngroups == self->groups_cap) {
        Py_ssize_t cap = self->groups_cap ? self->groups_cap * 2 : 4;
        Group *ng = PyMem_Realloc(self->groups, (size_t)cap * sizeof(Group));
        Py_ssize_t *nt = PyMem_Realloc(self->touched, (size_t)cap * sizeof(Py_ssize_t));
        if (ng != NULL)
            self->groups = ng;
        if (nt != NULL)
            self->touched = nt;
        if (ng == NULL || nt == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->groups_cap = cap;
    }
    Group *G = &self->groups[self->ngroups];
    memset(G, 0, sizeof(*G));
    Py_INCREF(gs);
    G->gs = gs;
    Py_INCREF(g);
    G->g = g;
    return self->ngroups++;
}

/* The entry of a key the shapes dict holds (``item``: the Shape, or None). */
static Entry *
new_entry(Scanner *self, Py_hash_t h, PyObject *key, PyObject *item)
{
    Entry *e = PyMem_Calloc(1, sizeof(Entry));
    if (e == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    e->hash = h;
    Py_INCREF(key);
    e->key = key;
    e->ddp = -1;
    if (item != Py_None) {
        PyObject *gs = NULL, *g = NULL;
        Py_INCREF(item);
        e->shape = item;
        if (get_attr(item, "op", &e->op, NULL) < 0 || get_attr(item, "site", &e->site, NULL) < 0
            || get_attr(item, "opsite", &e->opsite, NULL) < 0 || get_attr(item, "op_b", &e->op_b, &PyBytes_Type) < 0
            || get_attr(item, "sig_b", &e->sig_b, &PyBytes_Type) < 0 || get_attr(item, "gs", &gs, NULL) < 0)
            goto fail;
        if (get_attr(item, "g", &g, NULL) < 0) {
            Py_DECREF(gs);
            goto fail;
        }
        e->group = group_of(self, gs, g);
        Py_DECREF(gs);
        Py_DECREF(g);
        if (e->group < 0)
            goto fail;
        int ddp = truthy_attr(item, "ddp");
        e->train_fwd = truthy_attr(item, "train_fwd");
        e->barrier = truthy_attr(item, "barrier");
        if (ddp < 0 || e->train_fwd < 0 || e->barrier < 0)
            goto fail;
        for (Py_ssize_t i = 0; ddp && i < PyTuple_GET_SIZE(self->ddp_ops); i++) {
            int eq = PyObject_RichCompareBool(e->op, PyTuple_GET_ITEM(self->ddp_ops, i), Py_EQ);
            if (eq < 0)
                goto fail;
            if (eq) {
                e->ddp = (int)i;
                break;
            }
        }
    }
    if (insert(self, e) < 0)
        goto fail;
    return e;
fail:
    entry_free(e);
    return NULL;
}

static PyObject *
long_attr(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v != NULL && !PyLong_Check(v)) {
        Py_DECREF(v);
        PyErr_Format(PyExc_TypeError, "%s: not an int", name);
        return NULL;
    }
    return v;
}

/* Reads a group's state at its first line in a call. */
static int
group_load(Scanner *self, Py_ssize_t gi)
{
    Group *G = &self->groups[gi];
    PyObject *v;
    if ((v = long_attr(G->gs, "count")) == NULL)
        return -1;
    G->count = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if ((v = long_attr(G->gs, "_op")) == NULL)
        return -1;
    G->op = (uint32_t)PyLong_AsUnsignedLongMask(v);
    Py_DECREF(v);
    if ((v = long_attr(G->gs, "_sig")) == NULL)
        return -1;
    G->sig = (uint32_t)PyLong_AsUnsignedLongMask(v);
    Py_DECREF(v);
    if (PyErr_Occurred())
        return -1;
    if (get_attr(G->gs, "blocks", &G->blocks, &PyList_Type) < 0)
        return -1;
    G->prev_barrier = 0;
    G->prev_site = NULL;
    PyObject *prev = PyDict_GetItemWithError(self->last_op, G->g);  /* borrowed */
    if (prev == NULL && PyErr_Occurred())
        goto fail;
    if (prev != NULL && PyTuple_Check(prev) && PyTuple_GET_SIZE(prev) >= 2) {
        int b = PySequence_Contains(self->barriers, PyTuple_GET_ITEM(prev, 0));
        if (b < 0)
            goto fail;
        G->prev_barrier = b;
        G->prev_site = PyTuple_GET_ITEM(prev, 1);
        Py_INCREF(G->prev_site);
    }
    G->loaded = 1;
    self->touched[self->ntouched++] = gi;
    return 0;
fail:
    Py_CLEAR(G->blocks);
    return -1;
}

static int
set_long(PyObject *o, const char *name, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttrString(o, name, v);
    Py_DECREF(v);
    return r;
}

/* blocks[-1][0], blocks[-1][1] = op, sig */
static int
close_block(Group *G)
{
    Py_ssize_t nb = PyList_GET_SIZE(G->blocks);
    if (nb == 0)
        return 0;
    PyObject *last = PyList_GET_ITEM(G->blocks, nb - 1);
    PyObject *a = PyLong_FromUnsignedLong(G->op), *b = PyLong_FromUnsignedLong(G->sig);
    int r = -1;
    if (a != NULL && b != NULL && PySequence_SetItem(last, 0, a) == 0 && PySequence_SetItem(last, 1, b) == 0)
        r = 0;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* d[k] = d.get(k, 0) + n */
static int
dict_add(PyObject *d, PyObject *k, long long n)
{
    PyObject *old = PyDict_GetItemWithError(d, k);  /* borrowed */
    if (old == NULL && PyErr_Occurred())
        return -1;
    PyObject *add = PyLong_FromLongLong(n);
    if (add == NULL)
        return -1;
    PyObject *v = old == NULL ? add : PyNumber_Add(old, add);
    if (old != NULL)
        Py_DECREF(add);
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return r;
}

/* o.name = o.name + n (n > 0), or max(o.name, n) */
static int
attr_add(PyObject *o, const char *name, PyObject *n, int take_max)
{
    PyObject *old = PyObject_GetAttrString(o, name);
    if (old == NULL)
        return -1;
    PyObject *v;
    if (take_max) {
        int gt = PyObject_RichCompareBool(n, old, Py_GT);
        v = gt < 0 ? NULL : (gt ? n : old);
        Py_XINCREF(v);
    }
    else
        v = PyNumber_Add(old, n);
    Py_DECREF(old);
    return set_long(o, name, v);
}

/* The shape's events taken so far onto the Shape (n, total, longest). */
static int
flush_entry(Entry *e)
{
    if (e->n == 0 && e->total == 0)
        return 0;
    PyObject *n = PyLong_FromLongLong(e->n), *t = PyLong_FromUnsignedLongLong(e->total);
    PyObject *l = PyLong_FromLongLong(e->longest);
    int r = (n == NULL || t == NULL || l == NULL || attr_add(e->shape, "n", n, 0) < 0
             || attr_add(e->shape, "total", t, 0) < 0 || attr_add(e->shape, "longest", l, 1) < 0) ? -1 : 0;
    Py_XDECREF(n);
    Py_XDECREF(t);
    Py_XDECREF(l);
    if (r == 0)
        e->n = 0, e->total = 0, e->longest = 0;
    return r;
}

/* One line of a known shape: what fastscan.Bulk._short does for it. */
static int
account(Scanner *self, Entry *e, const Match *m, long long pos, Py_ssize_t at, Py_ssize_t len,
        Py_ssize_t taken)
{
    Group *G = &self->groups[e->group];
    if (!G->loaded && group_load(self, e->group) < 0)
        return -1;
    if (G->count % self->block == 0) {
        if (G->count && close_block(G) < 0)
            return -1;
        PyObject *b = Py_BuildValue("[iiL]", 0, 0, pos);
        if (b == NULL || PyList_Append(G->blocks, b) < 0) {
            Py_XDECREF(b);
            return -1;
        }
        Py_DECREF(b);
        G->op = G->sig = 0;
    }
    G->op = crc32_update(G->op, (const unsigned char *)PyBytes_AS_STRING(e->op_b), PyBytes_GET_SIZE(e->op_b));
    G->sig = crc32_update(G->sig, (const unsigned char *)PyBytes_AS_STRING(e->sig_b), PyBytes_GET_SIZE(e->sig_b));
    G->count++;
    long long d = m->d;
    if (e->total > UINT64_MAX - (uint64_t)d && flush_entry(e) < 0)
        return -1;
    e->n++;
    e->total += (uint64_t)d;
    if (d > e->longest)
        e->longest = d;
    if (m->ts + d > self->end)
        self->end = m->ts + d;
    if (e->ddp >= 0) {
        self->ddp_n[e->ddp]++;
        self->ddp_last[e->ddp] = e;
    }
    if (e->train_fwd)
        self->train_n++;
    if (G->prev_barrier) {
        PyObject *k = PyTuple_Pack(2, G->prev_site, e->op);
        int r = k == NULL ? -1 : dict_add(self->after, k, 1);
        Py_XDECREF(k);
        if (r < 0)
            return -1;
    }
    G->prev_barrier = e->barrier;
    Py_INCREF(e->site);
    Py_XSETREF(G->prev_site, e->site);
    G->last_opsite = e->opsite;
    Py_ssize_t slot = (taken % self->tail_max) * 2;
    self->tail_at[slot] = at;
    self->tail_at[slot + 1] = len;
    self->n++;
    return 0;
}

/* The end of a run() call: the groups' state, last events, DDP steps and tail back into the
 * Python objects the general path reads and writes between calls. ``ok``: 0 after an error
 * (then only the references are released). */
static int
write_back(Scanner *self, PyObject *buf, Py_ssize_t taken, int ok)
{
    int r = ok ? 0 : -1;
    for (Py_ssize_t t = 0; t < self->ntouched; t++) {
        Group *G = &self->groups[self->touched[t]];
        if (r == 0 && (set_long(G->gs, "count", PyLong_FromLongLong(G->count)) < 0
                       || set_long(G->gs, "_op", PyLong_FromUnsignedLong(G->op)) < 0
                       || set_long(G->gs, "_sig", PyLong_FromUnsignedLong(G->sig)) < 0
                       || (G->last_opsite != NULL && PyDict_SetItem(self->last_op, G->g, G->last_opsite) < 0)))
            r = -1;
        Py_CLEAR(G->blocks);
        Py_CLEAR(G->prev_site);
        G->last_opsite = NULL;
        G->loaded = 0;
    }
    self->ntouched = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->ddp_ops); i++) {
        if (self->ddp_n[i] && r == 0) {
            PyObject *op = PyTuple_GET_ITEM(self->ddp_ops, i);
            if (dict_add(self->ddp_steps, op, self->ddp_n[i]) < 0
                || PyDict_SetItem(self->ddp_sites, op, self->ddp_last[i]->site) < 0)
                r = -1;
        }
        self->ddp_n[i] = 0;
        self->ddp_last[i] = NULL;
    }
    if (self->train_n && r == 0) {
        PyObject *n = PyLong_FromLongLong(self->train_n);
        if (n == NULL || attr_add(self->rt, "ddp_train_fwd", n, 0) < 0)
            r = -1;
        Py_XDECREF(n);
    }
    self->train_n = 0;
    if (taken && r == 0) {
        Py_ssize_t k = taken < self->tail_max ? taken : self->tail_max;
        PyObject *lines = PyList_New(k);
        if (lines == NULL)
            return -1;
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_ssize_t slot = ((taken - k + j) % self->tail_max) * 2;
            PyObject *b = PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + self->tail_at[slot],
                                                    self->tail_at[slot + 1]);
            if (b == NULL) {
                Py_DECREF(lines);
                return -1;
            }
            PyList_SET_ITEM(lines, j, b);
        }
        PyObject *res = PyObject_CallMethod(self->tail, "extend", "O", lines);
        Py_DECREF(lines);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return r;
}

PyDoc_STRVAR(run_doc,
"run(buf, i, base) -> (stop, end, key)\n\n"
"Account the lines of known shapes in ``buf`` (whole lines; ``base``: the file offset of\n"
"buf[0]) from index ``i`` on, up to the first line the general path must read: that line is\n"
"buf[stop:end] and ``key`` its shape key (None when it is not of the layout); ``stop`` is\n"
"len(buf) when every line was taken.");

static PyObject *
Scanner_run(Scanner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run(buf: bytes, i: int, base: int)");
        return NULL;
    }
    PyObject *buf = args[0];
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    long long base = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    const char *s = PyBytes_AS_STRING(buf);
    Py_ssize_t len = PyBytes_GET_SIZE(buf);
    if (i < 0 || i > len) {
        PyErr_SetString(PyExc_ValueError, "run: index out of range");
        return NULL;
    }
    Py_ssize_t taken = 0, stop_end = len;
    PyObject *key = NULL;
    while (i < len) {
        const char *ls = s + i;
        const char *nl = memchr(ls, '\n', (size_t)(len - i));
        if (nl == NULL) {
            stop_end = len;
            break;  /* not a whole line: the general path's */
        }
        stop_end = (nl + 1) - s;
        Match m;
        if (!match_line(ls, nl, &m))
            break;
        Py_ssize_t q = quick_hash(&m);
        Entry *e = self->quick[q];
        Py_hash_t h = 0;
        if (e == NULL || !key_equal(e->key, &m)) {
            h = key_hash(&m);
            e = lookup(self, h, &m);
            if (e != NULL)
                self->quick[q] = e;
        }
        if (e == NULL) {
            PyObject *k = make_key(&m);
            if (k == NULL)
                goto error;
            PyObject *item = PyDict_GetItemWithError(self->shapes, k);
            if (item == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(k);
                    goto error;
                }
                key = k;  /* not known yet: the general path may make its shape */
                break;
            }
            Py_INCREF(item);
            e = new_entry(self, h, k, item);
            Py_DECREF(item);
            Py_DECREF(k);
            if (e == NULL)
                goto error;
        }
        if (e->shape == NULL) {
            Py_INCREF(e->key);
            key = e->key;
            break;
        }
        if (account(self, e, &m, base + i, i, stop_end - i, taken) < 0)
            goto error;
        taken++;
        i = stop_end;
    }
    if (i >= len)
        stop_end = len;
    if (write_back(self, buf, taken, 1) < 0) {
        Py_XDECREF(key);
        return NULL;
    }
    return Py_BuildValue("nnN", i, stop_end, key != NULL ? key : (Py_INCREF(Py_None), Py_None));
error:
    write_back(self, buf, 0, 0);
    return NULL;
}

PyDoc_STRVAR(finish_doc,
"finish() -> (n, end)\n\n"
"Write each shape's events taken (n, total and longest d) onto its Shape; returns the events\n"
"taken and their latest end (ts + d) since the last finish().");

static PyObject *
Scanner_finish(Scanner *self, PyObject *unused)
{
    (void)unused;
    for (Py_ssize_t i = 0; i < self->cap; i++) {
        Entry *e = self->table[i];
        if (e != NULL && e->shape != NULL && flush_entry(e) < 0)
            return NULL;
    }
    PyObject *res = Py_BuildValue("LL", self->n, self->end);
    self->n = self->end = 0;
    return res;
}

static PyMethodDef Scanner_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Scanner_run, METH_FASTCALL, run_doc},
    {"finish", (PyCFunction)Scanner_finish, METH_NOARGS, finish_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Scanner_doc,
"Scanner(rt, shapes, block, barriers, ddp_ops)\n\n"
"The bulk path of one rank file (fastscan.Bulk): ``rt`` the RankTrace, ``shapes`` the loader's\n"
"shape dict (key -> Shape or None), ``block`` events a digest block, ``barriers`` the barrier\n"
"ops (a set), ``ddp_ops`` the DDP step ops (a tuple).");

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.analysis._bulkscan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Scanner_doc,
    .tp_methods = Scanner_methods,
    .tp_new = Scanner_new,
};

/* crc32(data, crc=0): for the tests, which hold the table-driven crc to zlib's. */
static PyObject *
bulk_crc32(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k", &b, &crc))
        return NULL;
    uint32_t r = crc32_update((uint32_t)crc, b.buf, b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(r);
}

/* match(line) -> key or None: the shape key the pattern gives a whole line, for the tests. */
static PyObject *
bulk_match(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "match(line: bytes)");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg);
    Match m;
    if (n == 0 || s[n - 1] != '\n' || memchr(s, '\n', (size_t)n) != s + n - 1 || !match_line(s, s + n - 1, &m))
        Py_RETURN_NONE;
    PyObject *key = make_key(&m);
    if (key == NULL)
        return NULL;
    return Py_BuildValue("NLL", key, m.ts, m.d);
}

PyDoc_STRVAR(lines_doc,
"lines(buf) -> [(line, key), ...]\n\n"
"Every line of ``buf`` (whole lines) with its shape key, None when it is not of the layout: what\n"
"fastscan._SCAN.findall's rows give, gap lines split (regroup.py).");

static PyObject *
bulk_lines(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "lines(buf: bytes)");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg), i = 0;
    PyObject *out = PyList_New(0);
    while (out != NULL && i < n) {
        const char *nl = memchr(s + i, '\n', (size_t)(n - i));
        Py_ssize_t end = nl == NULL ? n : (nl + 1) - s;
        Match m;
        PyObject *key = Py_None, *line = PyBytes_FromStringAndSize(s + i, end - i), *pair = NULL;
        Py_INCREF(key);
        if (nl != NULL && line != NULL && match_line(s + i, nl, &m)) {
            Py_DECREF(key);
            key = make_key(&m);
        }
        if (line != NULL && key != NULL)
            pair = PyTuple_Pack(2, line, key);
        Py_XDECREF(line);
        Py_XDECREF(key);
        if (pair == NULL || PyList_Append(out, pair) < 0)
            Py_CLEAR(out);
        Py_XDECREF(pair);
        i = end;
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"lines", bulk_lines, METH_O, lines_doc},
    {"crc32", bulk_crc32, METH_VARARGS, "zlib.crc32's value, table-driven (for the tests)."},
    {"match", bulk_match, METH_O, "match(line) -> ((opg, mid, site, rest), ts, d) or None (for the tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bulkscan",
    "The loader's bulk path in C (ddpdoctor/analysis/fastscan.py has the Python reference).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__bulkscan(void)
{
    crc_init();
    if (PyType_Ready(&ScannerType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(mod, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}

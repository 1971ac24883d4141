/* What the rank side's C extensions share (_fastcall.c, _warnsite.c, _ddpstep.c); included
 * after <Python.h>. */
#ifndef DDPDOCTOR_RANK_NATIVE_H
#define DDPDOCTOR_RANK_NATIVE_H

/* 3.11: the interpreter's frames read in place (no frame objects made); other versions: frame
 * objects through the public API. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define FAST_FRAMES 1
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#else
#define FAST_FRAMES 0
#endif

/* The decimal digits of v, as b"%d" writes them, at p (21 bytes free at least); returns the end. */
static inline char *
ddp_put_ll(char *p, long long v)
{
    char tmp[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *p++ = '-';
    while (n)
        *p++ = tmp[--n];
    return p;
}

#endif

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and RocksDB.
 *
 * x86-64 with SSE4.2 (checked at run time): the crc32 instruction on three independent streams
 * at once. The instruction has a latency of 3 cycles and a throughput of 1 per cycle, so one
 * stream runs at a third of the possible speed; the three partial CRCs are merged with
 * "append N zero bytes" operators (tables built once at import). This is Mark Adler's scheme
 * (zlib license, https://stackoverflow.com/a/17646775). Elsewhere: a byte-wise table.
 *
 * kv_crc32c_init() must run once before use (module import does it, holding the GIL). */
#ifndef KV_CRC32C_H
#define KV_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_CRC32C_POLY 0x82f63b78u
#define KV_CRC32C_LONG 8192  /* bytes per stream in a long 3-way block */
#define KV_CRC32C_SHORT 256  /* bytes per stream in a short 3-way block */

static uint32_t kv_crc32c_table[256];     /* byte-wise software table */
static uint32_t kv_crc32c_long[4][256];   /* operator: append KV_CRC32C_LONG zero bytes */
static uint32_t kv_crc32c_short[4][256];  /* operator: append KV_CRC32C_SHORT zero bytes */
static int kv_crc32c_have_hw = 0;

static uint32_t kv_gf2_matrix_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void kv_gf2_matrix_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = kv_gf2_matrix_times(mat, mat[n]);
}

/* Operator that appends len (a power of two) zero bytes to a raw (unconditioned) CRC. */
static void kv_crc32c_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = KV_CRC32C_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    kv_gf2_matrix_square(even, odd); /* two zero bits */
    kv_gf2_matrix_square(odd, even); /* four zero bits */
    do { /* first square gives one zero byte; each further square doubles it */
        kv_gf2_matrix_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        kv_gf2_matrix_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void kv_crc32c_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    kv_crc32c_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = kv_gf2_matrix_times(op, n);
        zeros[1][n] = kv_gf2_matrix_times(op, n << 8);
        zeros[2][n] = kv_gf2_matrix_times(op, n << 16);
        zeros[3][n] = kv_gf2_matrix_times(op, n << 24);
    }
}

static inline uint32_t kv_crc32c_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

static uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *next = (const unsigned char *)buf;
    crc = ~crc;
    while (len--) crc = (crc >> 8) ^ kv_crc32c_table[(crc ^ *next++) & 0xff];
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KV_CRC32C_X86 1

static inline uint64_t kv_load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* one mov; no alignment or aliasing assumptions */
    return v;
}

/* One 3-way pass over blocks of 3*stride bytes; returns the bytes left over. */
#define KV_CRC32C_3WAY(stride, table)                                            \
    while (len >= 3 * (size_t)(stride)) {                                        \
        uint64_t crc1 = 0, crc2 = 0;                                             \
        const unsigned char *end = next + (stride);                              \
        do {                                                                     \
            crc0 = _mm_crc32_u64(crc0, kv_load64(next));                         \
            crc1 = _mm_crc32_u64(crc1, kv_load64(next + (stride)));              \
            crc2 = _mm_crc32_u64(crc2, kv_load64(next + 2 * (stride)));          \
            next += 8;                                                           \
        } while (next < end);                                                    \
        crc0 = kv_crc32c_shift(table, (uint32_t)crc0) ^ crc1;                    \
        crc0 = kv_crc32c_shift(table, (uint32_t)crc0) ^ crc2;                    \
        next += 2 * (stride);                                                    \
        len -= 3 * (size_t)(stride);                                             \
    }

__attribute__((target("sse4.2")))
static uint32_t kv_crc32c_hw(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *next = (const unsigned char *)buf;
    uint64_t crc0 = ~crc;
    while (len && ((uintptr_t)next & 7) != 0) { /* align the stream to 8 bytes */
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    KV_CRC32C_3WAY(KV_CRC32C_LONG, kv_crc32c_long)
    KV_CRC32C_3WAY(KV_CRC32C_SHORT, kv_crc32c_short)
    const unsigned char *end = next + (len & ~(size_t)7);
    while (next < end) {
        crc0 = _mm_crc32_u64(crc0, kv_load64(next));
        next += 8;
    }
    len &= 7;
    while (len--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    return ~(uint32_t)crc0;
}

/* ---- carry-less multiplication folding (AVX-512 VPCLMULQDQ), checked at run time ----------------
 * 4 x 512-bit accumulators fold the message 256 bytes at a time; the folded state is finally fed
 * to the crc32 instruction as 16 message bytes. Where the data comes from memory rather than cache
 * (a freshly read page) it runs at the memory's read speed (28 GB/s here against 15 GB/s for the
 * 3-way crc32 loop), and with a destination it copies in the same pass (as fast as memcpy alone).
 *
 * Constants: a 16-byte lane X moved F bytes later in the message contributes
 * X.lo * x^(8F+64) + X.hi * x^(8F) (mod P), X.lo holding the higher degrees (bit-reflected). A
 * reflected carry-less product reads one degree high, and a 32-bit constant in the low half of a
 * 64-bit operand is pre-multiplied by x^32: hence x^(8F+31) and x^(8F-33). */
#include <immintrin.h>
#define KV_FOLD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2")))
#define KV_FOLD_MIN 256 /* shortest input folded; shorter ones take the 3-way loop */

static uint64_t kv_fold_k[6][2]; /* fold by F = 256, 64, 48, 32, 16, 128 bytes */
static int kv_crc32c_have_fold = 0;

static uint32_t kv_xnmodp(uint64_t n) { /* x^n mod P, bit-reflected like the CRC register */
    uint32_t v = 0x80000000u;
    while (n--) v = (v & 1) ? (v >> 1) ^ KV_CRC32C_POLY : v >> 1;
    return v;
}

static void kv_fold_init(void) {
    static const unsigned dist[6] = {256, 64, 48, 32, 16, 128};
    for (int i = 0; i < 6; i++) {
        kv_fold_k[i][0] = kv_xnmodp(8 * (uint64_t)dist[i] + 31);
        kv_fold_k[i][1] = kv_xnmodp(8 * (uint64_t)dist[i] - 33);
    }
}

KV_FOLD_TARGET static inline __m512i kv_fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

KV_FOLD_TARGET static inline __m128i kv_fold128(__m128i x, int i, __m128i next) {
    __m128i k = _mm_loadu_si128((const __m128i *)kv_fold_k[i]);
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11), next,
                                  0x96);
}

/* The copy's stores. A copy of at least KV_STREAM_MIN bytes into a 64-byte aligned destination
 * streams it (non-temporal stores): a read's destination is caller memory that nothing on this CPU
 * reads soon (the host pool, which the GPU's DMA or a later layer copy takes), so the stores skip
 * the read-for-ownership of every destination line and leave the cache to the next staged blocks.
 * Measured on this machine's EPYC (1 MiB blocks, fused with the CRC): 0.050 -> 0.035 s/GB with the
 * source in cache, 0.080 -> 0.052 from DRAM. Streaming stores are weakly ordered: the copy ends with
 * an sfence, so they are visible before anything the caller does after it. */
#define KV_STREAM_MIN (64 << 10)

static inline int kv_streams(const unsigned char *dst, size_t len) {
    return dst && len >= KV_STREAM_MIN && ((uintptr_t)dst & 63) == 0;
}

/* The end of either fold: its folded state z (16 bytes) through the crc32 instruction, then the len
 * bytes left at src (fewer than one vector), copied to dst too if not NULL; an sfence after a streamed
 * copy. */
__attribute__((target("sse4.2"))) static inline uint32_t kv_fold_end(__m128i z, unsigned char *dst,
                                                                     const unsigned char *src, size_t len,
                                                                     int stream) {
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(z)); /* the state as 16 message bytes */
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(z, 1));
    if (dst && len) memcpy(dst, src, len);
    if (stream) _mm_sfence();
    while (len >= 8) {
        c = _mm_crc32_u64(c, kv_load64(src));
        src += 8;
        len -= 8;
    }
    while (len--) c = _mm_crc32_u8((uint32_t)c, *src++);
    return ~(uint32_t)c;
}

KV_FOLD_TARGET static inline void kv_store64(unsigned char *dst, __m512i a, int stream) {
    if (stream)
        _mm512_stream_si512((void *)dst, a);
    else
        _mm512_storeu_si512(dst, a);
}

KV_FOLD_TARGET static inline void kv_store256(unsigned char *dst, __m512i a, __m512i b, __m512i c, __m512i d,
                                              int stream) {
    kv_store64(dst, a, stream);
    kv_store64(dst + 64, b, stream);
    kv_store64(dst + 128, c, stream);
    kv_store64(dst + 192, d, stream);
}

/* CRC of len >= KV_FOLD_MIN bytes at src; with dst (not NULL) the bytes are copied there too. */
KV_FOLD_TARGET static uint32_t kv_crc32c_fold(uint32_t crc, unsigned char *dst, const unsigned char *src,
                                              size_t len) {
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_fold_k[0]));
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_fold_k[1]));
    const int stream = kv_streams(dst, len);
    __m512i x0 = _mm512_loadu_si512(src), x1 = _mm512_loadu_si512(src + 64);
    __m512i x2 = _mm512_loadu_si512(src + 128), x3 = _mm512_loadu_si512(src + 192);
    if (dst) {
        kv_store256(dst, x0, x1, x2, x3, stream);
        dst += 256;
    }
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc))); /* the initial CRC */
    src += 256;
    len -= 256;
    while (len >= 256) {
        __m512i n0 = _mm512_loadu_si512(src), n1 = _mm512_loadu_si512(src + 64);
        __m512i n2 = _mm512_loadu_si512(src + 128), n3 = _mm512_loadu_si512(src + 192);
        if (dst) {
            kv_store256(dst, n0, n1, n2, n3, stream);
            dst += 256;
        }
        x0 = kv_fold512(x0, k256, n0);
        x1 = kv_fold512(x1, k256, n1);
        x2 = kv_fold512(x2, k256, n2);
        x3 = kv_fold512(x3, k256, n3);
        src += 256;
        len -= 256;
    }
    x1 = kv_fold512(x0, k64, x1); /* four accumulators into one */
    x2 = kv_fold512(x1, k64, x2);
    x3 = kv_fold512(x2, k64, x3);
    while (len >= 64) {
        __m512i n = _mm512_loadu_si512(src);
        if (dst) {
            kv_store64(dst, n, stream);
            dst += 64;
        }
        x3 = kv_fold512(x3, k64, n);
        src += 64;
        len -= 64;
    }
    __m128i z = _mm512_extracti32x4_epi32(x3, 3); /* four lanes into one */
    z = kv_fold128(_mm512_extracti32x4_epi32(x3, 0), 2, z);
    z = kv_fold128(_mm512_extracti32x4_epi32(x3, 1), 3, z);
    z = kv_fold128(_mm512_extracti32x4_epi32(x3, 2), 4, z);
    return kv_fold_end(z, dst, src, len, stream);
}

/* The same folding with 256-bit vectors, for CPUs with VPCLMULQDQ and AVX2 but no AVX-512 (AMD Zen 3,
 * Intel Alder Lake and later client parts). Measured on an EPYC without AVX-512 (Zen 3; 256 MiB from
 * DRAM, CPU time): the fused copy + CRC takes 0.07 s/GB in 1 MiB blocks against 0.145 for a memcpy
 * followed by the 3-way loop over the copy (4 KiB blocks, not streamed: 0.12 against 0.16); the CRC
 * alone runs as fast as the 3-way loop (0.06 s/GB), so the copy is where it pays. 4 x 256-bit
 * accumulators fold 128 bytes at a time. */
#define KV_FOLD2_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

static int kv_crc32c_have_fold2 = 0;

KV_FOLD2_TARGET static inline __m256i kv_fold256(__m256i x, __m256i k, __m256i next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), next);
}

KV_FOLD2_TARGET static inline __m256i kv_load_store32(unsigned char *dst, const unsigned char *src, int stream) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    if (stream)
        _mm256_stream_si256((__m256i *)dst, a);
    else if (dst)
        _mm256_storeu_si256((__m256i *)dst, a);
    return a;
}

/* CRC of len >= KV_FOLD_MIN bytes at src; with dst (not NULL) the bytes are copied there too. */
KV_FOLD2_TARGET static uint32_t kv_crc32c_fold2(uint32_t crc, unsigned char *dst, const unsigned char *src,
                                                size_t len) {
    const __m256i k128 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_fold_k[5]));
    const __m256i k32 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_fold_k[3]));
    const int stream = kv_streams(dst, len);
    __m256i x[4];
    for (int i = 0; i < 4; i++) x[i] = kv_load_store32(dst ? dst + 32 * i : NULL, src + 32 * i, stream);
    x[0] = _mm256_xor_si256(x[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)~crc))); /* the initial CRC */
    if (dst) dst += 128;
    src += 128;
    len -= 128;
    while (len >= 128) {
        for (int i = 0; i < 4; i++)
            x[i] = kv_fold256(x[i], k128, kv_load_store32(dst ? dst + 32 * i : NULL, src + 32 * i, stream));
        if (dst) dst += 128;
        src += 128;
        len -= 128;
    }
    x[1] = kv_fold256(x[0], k32, x[1]); /* four accumulators into one */
    x[2] = kv_fold256(x[1], k32, x[2]);
    x[3] = kv_fold256(x[2], k32, x[3]);
    while (len >= 32) {
        x[3] = kv_fold256(x[3], k32, kv_load_store32(dst, src, stream));
        if (dst) dst += 32;
        src += 32;
        len -= 32;
    }
    const __m128i k16 = _mm_loadu_si128((const __m128i *)kv_fold_k[4]); /* two lanes into one */
    const __m128i lo = _mm256_castsi256_si128(x[3]);
    __m128i z = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lo, k16, 0x00), _mm_clmulepi64_si128(lo, k16, 0x11)),
                              _mm256_extracti128_si256(x[3], 1));
    return kv_fold_end(z, dst, src, len, stream);
}

/* Copy + CRC where the CPU has no VPCLMULQDQ (Intel Cascade Lake, AMD Zen 2). A copy that streams (as
 * in the folds: at least KV_STREAM_MIN bytes into 64-byte aligned memory) goes KV_COPY_CHUNK bytes at a
 * time: copied with non-temporal stores, then the 3-way loop reads that source chunk again from L1/L2,
 * so memory is read once and the destination never. Measured on an EPYC without AVX-512 (Zen 3, 1 MiB
 * blocks from DRAM, CPU time): 0.12-0.13 s/GB against 0.16-0.17 for a memcpy followed by the 3-way loop
 * over the copy (a 128-bit PCLMULQDQ fold, tried: 0.11-0.17). */
#define KV_COPY_CHUNK 8192

__attribute__((target("sse4.2"))) static uint32_t kv_crc32c_copy_hw(uint32_t crc, unsigned char *dst,
                                                                      const unsigned char *src, size_t len) {
    if (!kv_streams(dst, len)) {
        memcpy(dst, src, len);
        return kv_crc32c_hw(crc, dst, len);
    }
    while (len) {
        size_t n = len < KV_COPY_CHUNK ? len : KV_COPY_CHUNK, i = 0;
        for (; i + 64 <= n; i += 64)
            for (int q = 0; q < 4; q++)
                _mm_stream_si128((__m128i *)(dst + i + 16 * q), _mm_loadu_si128((const __m128i *)(src + i + 16 * q)));
        memcpy(dst + i, src + i, n - i);
        crc = kv_crc32c_hw(crc, src, n);
        src += n;
        dst += n;
        len -= n;
    }
    _mm_sfence();
    return crc;
}
#endif

static void kv_crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ KV_CRC32C_POLY : c >> 1;
        kv_crc32c_table[n] = c;
    }
#ifdef KV_CRC32C_X86
    kv_crc32c_zeros(kv_crc32c_long, KV_CRC32C_LONG);
    kv_crc32c_zeros(kv_crc32c_short, KV_CRC32C_SHORT);
    __builtin_cpu_init();
    /* __builtin_cpu_supports returns the feature's bit of GCC's mask (e.g. 256), not 1: normalised,
       since kv_crc32c_hardware() indexes the names with it (an AMD EPYC without AVX-512 read past
       the tuple at import and crashed). */
    kv_crc32c_have_hw = __builtin_cpu_supports("sse4.2") != 0;
    kv_fold_init();
    kv_crc32c_have_fold = kv_crc32c_have_hw && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
    kv_crc32c_have_fold2 = kv_crc32c_have_hw && __builtin_cpu_supports("avx2") &&
                           __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
#endif
}

/* crc: the CRC of the preceding data (0 to start), so crc32c(b, crc32c(a)) == crc32c(a + b). */
static uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t len) {
#ifdef KV_CRC32C_X86
    if (kv_crc32c_have_fold && len >= KV_FOLD_MIN) return kv_crc32c_fold(crc, NULL, buf, len);
    if (kv_crc32c_have_fold2 && len >= KV_FOLD_MIN) return kv_crc32c_fold2(crc, NULL, buf, len);
    if (kv_crc32c_have_hw) return kv_crc32c_hw(crc, buf, len);
#endif
    return kv_crc32c_sw(crc, buf, len);
}

/* Copy len bytes from src to dst and return the CRC of them, in one pass where the CPU can. */
static uint32_t kv_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len) {
#ifdef KV_CRC32C_X86
    if (kv_crc32c_have_fold && len >= KV_FOLD_MIN) return kv_crc32c_fold(crc, dst, src, len);
    if (kv_crc32c_have_fold2 && len >= KV_FOLD_MIN) return kv_crc32c_fold2(crc, dst, src, len);
    if (kv_crc32c_have_hw) return kv_crc32c_copy_hw(crc, dst, src, len);
#endif
    memcpy(dst, src, len);
    return kv_crc32c(crc, dst, len);
}

/* Tests: the CRC of src through implementation impl (numbered as kv_crc32c_hardware() numbers them),
 * copying the bytes to dst as well where dst is not NULL; -1 where this CPU lacks it, or a fold is
 * asked for fewer than KV_FOLD_MIN bytes. Every path the CPU has gets checked, not only the fastest. */
static int64_t kv_crc32c_by(int impl, uint32_t crc, void *dst, const void *src, size_t len) {
    if (impl == 0) {
        if (dst) memcpy(dst, src, len);
        return kv_crc32c_sw(crc, src, len);
    }
#ifdef KV_CRC32C_X86
    if (impl == 1 && kv_crc32c_have_hw)
        return dst ? kv_crc32c_copy_hw(crc, dst, src, len) : kv_crc32c_hw(crc, src, len);
    if (len >= KV_FOLD_MIN && impl == 2 && kv_crc32c_have_fold) return kv_crc32c_fold(crc, dst, src, len);
    if (len >= KV_FOLD_MIN && impl == 3 && kv_crc32c_have_fold2) return kv_crc32c_fold2(crc, dst, src, len);
#endif
    return -1;
}

/* The implementation in use: 3 = VPCLMULQDQ folding with AVX2, 2 = with AVX-512, 1 = crc32
 * instruction 3-way, 0 = table. */
static int kv_crc32c_hardware(void) {
#ifdef KV_CRC32C_X86
    if (kv_crc32c_have_fold) return 2;
    if (kv_crc32c_have_fold2) return 3;
#endif
    return kv_crc32c_have_hw;
}

#endif /* KV_CRC32C_H */

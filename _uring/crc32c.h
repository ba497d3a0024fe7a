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
    kv_crc32c_have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

/* crc: the CRC of the preceding data (0 to start), so crc32c(b, crc32c(a)) == crc32c(a + b). */
static uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t len) {
#ifdef KV_CRC32C_X86
    if (kv_crc32c_have_hw) return kv_crc32c_hw(crc, buf, len);
#endif
    return kv_crc32c_sw(crc, buf, len);
}

/* 1 when the hardware path is in use (reported by crc32c_backend()). */
static int kv_crc32c_hardware(void) { return kv_crc32c_have_hw; }

#endif /* KV_CRC32C_H */

/* Element-wise kernels whose result for a value depends on nothing but that value.
 *
 * PyTorch's CPU loops compute most of a tensor with vector code and the few elements left over
 * at the end of each thread's share with scalar code, and the vector exp, sin and cos (SLEEF)
 * and the scalar ones (libm) differ in the last bit. Which elements are left over follows the
 * tensor's size and the thread count, so the same token's SiLU or rotary rows change with what
 * else is in the batch. Here every row is cut into blocks of LANES columns (the last one padded)
 * and every block goes through the same code, so a column is always computed by the same
 * instructions; libm's scalar sin and cos, never vectorized, serve the rotary rows.
 *
 * Layouts: gate_up (rows, 2 * inter), gate first, contiguous; out (rows, inter).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The order of every lane's operations stays as written (the build reassociates elsewhere). */
#pragma GCC optimize("no-associative-math")

#define LANES 64
#define SEGMENT 512 /* columns one task takes: a multiple of LANES */

/* e^x, about one unit in the last place (Cephes' polynomial); overflow gives inf and deep
 * underflow 0, as expf does. */
static inline float exp_one(float x) {
    /* Comparisons, which vectorize (fminf's NaN rules do not); NaN becomes 89 (SiLU keeps it). */
    float v = x < 89.0f ? x : 89.0f;
    v = v > -104.0f ? v : -104.0f;
    float n = rintf(v * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, v);
    r = fmaf(-n, -2.12194440e-4f, r);
    float q = 1.9875691500e-4f;
    q = fmaf(q, r, 1.3981999507e-3f);
    q = fmaf(q, r, 8.3334519073e-3f);
    q = fmaf(q, r, 4.1665795894e-2f);
    q = fmaf(q, r, 1.6666665459e-1f);
    q = fmaf(q, r, 5.0000001201e-1f);
    float p = fmaf(q, r * r, r) + 1.0f;
    /* 2^n in two halves, so n from -150 to 128 stays within normal exponents. */
    int32_t whole = (int32_t)n, half = whole >> 1;
    uint32_t bits_lo = (uint32_t)(half + 127) << 23, bits_hi = (uint32_t)(whole - half + 127) << 23;
    float lo, hi;
    memcpy(&lo, &bits_lo, sizeof lo);
    memcpy(&hi, &bits_hi, sizeof hi);
    return p * lo * hi;
}

/* bfloat16 to and from float32 over a block, as paged_attention.c converts one value; written
 * on whole arrays of bits, which GCC vectorizes (it does not see through a value's memcpy
 * here). */
static void bf16_block_to_f32(const uint16_t *restrict x, float *restrict out) {
    uint32_t bits[LANES];
    for (int k = 0; k < LANES; k++) bits[k] = (uint32_t)x[k] << 16;
    memcpy(out, bits, sizeof bits);
}

static void f32_block_to_bf16(const float *restrict x, uint16_t *restrict out) {
    uint32_t bits[LANES];
    memcpy(bits, x, sizeof bits);
    for (int k = 0; k < LANES; k++) {
        uint32_t rounded = (bits[k] + 0x7fffu + ((bits[k] >> 16) & 1u)) >> 16;
        uint32_t nan = (bits[k] >> 16) | 0x40u;
        uint32_t is_nan = 0u - (uint32_t)((bits[k] & 0x7fffffffu) > 0x7f800000u); /* ~0 or 0 */
        out[k] = (uint16_t)((nan & is_nan) | (rounded & ~is_nan));
    }
}

/* silu(g) for one block of LANES columns, always whole (the caller pads the last one). Not
 * inlined, so GCC compiles the loop alone, with a fixed trip count, and vectorizes it: a
 * column's lane, and so its instructions, never change. */
__attribute__((noinline)) static void silu_lanes(const float *restrict g, float *restrict s) {
    for (int k = 0; k < LANES; k++) s[k] = g[k] / (1.0f + exp_one(-g[k]));
}

/* silu(g) * u, rounded where PyTorch rounds: after the SiLU and after the product. */
static void silu_and_mul_f32_lanes(const float *restrict g, const float *restrict u,
                                   float *restrict o) {
    float s[LANES];
    silu_lanes(g, s);
    for (int k = 0; k < LANES; k++) o[k] = s[k] * u[k];
}

static void silu_and_mul_bf16_lanes(const uint16_t *restrict g, const uint16_t *restrict u,
                                    uint16_t *restrict o) {
    float gv[LANES], uv[LANES], s[LANES];
    uint16_t rounded[LANES];
    bf16_block_to_f32(g, gv);
    bf16_block_to_f32(u, uv);
    silu_lanes(gv, s);
    f32_block_to_bf16(s, rounded);
    bf16_block_to_f32(rounded, s);
    for (int k = 0; k < LANES; k++) s[k] *= uv[k];
    f32_block_to_bf16(s, o);
}

#define DEFINE_SILU_MUL(NAME, T)                                                                  \
    int NAME(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {                \
        if (rows < 0 || inter <= 0) return 1;                                                     \
        int64_t segments = (inter + SEGMENT - 1) / SEGMENT;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int64_t task = 0; task < rows * segments; task++) {                                  \
            int64_t row = task / segments, first = task % segments * SEGMENT;                     \
            int64_t last = first + SEGMENT < inter ? first + SEGMENT : inter;                     \
            const T *g = gate_up + row * 2 * inter, *u = g + inter;                               \
            T *o = out + row * inter;                                                             \
            int64_t c = first;                                                                    \
            for (; c + LANES <= last; c += LANES) NAME##_lanes(g + c, u + c, o + c);              \
            if (c < last) {                                                                       \
                T gp[LANES] = {0}, up[LANES] = {0}, op[LANES];                                    \
                memcpy(gp, g + c, (size_t)(last - c) * sizeof(T));                                \
                memcpy(up, u + c, (size_t)(last - c) * sizeof(T));                                \
                NAME##_lanes(gp, up, op);                                                         \
                memcpy(o + c, op, (size_t)(last - c) * sizeof(T));                                \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_SILU_MUL(silu_and_mul_f32, float)
DEFINE_SILU_MUL(silu_and_mul_bf16, uint16_t)

/* Rotary rows as transformers computes them: angle = float(position) * inv_freq[j], the table's
 * two halves equal, cos and sin scaled by the attention factor. libm's cosf and sinf, called one
 * value at a time (no vectorized variant is declared without -ffast-math). */
__attribute__((optimize("no-tree-vectorize"))) int rope_table(const int64_t *positions,
                                                              const float *inv_freq, int64_t rows,
                                                              int64_t half, float scale,
                                                              float *cos_out, float *sin_out,
                                                              int threads) {
    if (rows < 0 || half <= 0) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < rows; row++) {
        float *c = cos_out + row * 2 * half, *s = sin_out + row * 2 * half;
        for (int64_t j = 0; j < half; j++) {
            float angle = (float)positions[row] * inv_freq[j];
            c[j] = c[half + j] = cosf(angle) * scale;
            s[j] = s[half + j] = sinf(angle) * scale;
        }
    }
    return 0;
}

/* Decode attention straight from the paged KV cache, for the CPU.
 *
 * One query token per sequence attends to its context, read block by block through its
 * block table: each K and V row is read once from the pool, with no gathered copy. Work is
 * split over (sequence, KV head) pairs; the query heads of one KV head (grouped-query
 * attention) share each K/V row they read. Scores are kept in float32, softmax is exact (two
 * passes over the scores), and the weighted sum of V accumulates in float32.
 *
 * The context is positions [start, len): start is 0 but under a sliding window, where the blocks
 * before it may already be given back to the pool and are never read (context_starts NULL: 0).
 *
 * Cache layout: (kv_heads, slots, head_dim), slot = block_id * block_size + offset.
 * bfloat16 values are handled as their upper 16 bits of a float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Blocks are scattered over the pool, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 1);
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                     \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,          \
         const int64_t *context_lens, const int64_t *context_starts, T *out, int64_t n, int64_t heads, int64_t kv_heads,      \
         int64_t head_dim, int64_t slots, int64_t block_size, int64_t max_blocks, float scale,  \
         int num_threads) {                                                                    \
    const int64_t group = heads / kv_heads;                                                    \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return 1;                                \
    int failed = 0;                                                                            \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")      \
    for (int64_t i = 0; i < n; i++) {                                                          \
        for (int64_t h = 0; h < kv_heads; h++) {                                               \
            const int64_t end = context_lens[i];                                               \
            const int64_t start = context_starts ? context_starts[i] : 0;                      \
            const int64_t ctx = end - start;                                                   \
            float qf[MAX_GROUP][MAX_HEAD_DIM];                                                 \
            float acc[MAX_GROUP][MAX_HEAD_DIM];                                                \
            float *scores = malloc(sizeof(float) * group * (ctx > 0 ? ctx : 1));               \
            if (!scores) { failed = 1; continue; }                                             \
            for (int64_t g = 0; g < group; g++) {                                              \
                const T *qrow = q + (i * heads + h * group + g) * head_dim;                    \
                for (int64_t d = 0; d < head_dim; d++) qf[g][d] = LOAD(qrow[d]) * scale;       \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;                       \
            }                                                                                  \
            const int64_t *table = block_tables + i * max_blocks;                              \
            const int64_t nblocks = (end + block_size - 1) / block_size;                       \
            for (int64_t b = start / block_size; b < nblocks; b++) {                           \
                const int64_t t0 = b * block_size - start; /* may be < 0 in the first block */ \
                const int64_t rows = end - b * block_size < block_size ? end - b * block_size   \
                                                                       : block_size;           \
                const int64_t j0 = t0 < 0 ? -t0 : 0;                                           \
                const T *kblock = k_cache + (h * slots + table[b] * block_size) * head_dim;    \
                if (b + 1 < nblocks) prefetch_block(                                           \
                    k_cache + (h * slots + table[b + 1] * block_size) * head_dim,              \
                    block_size * head_dim * (int64_t)sizeof(T));                               \
                for (int64_t j = j0; j < rows; j++) {                                          \
                    const T *krow = kblock + j * head_dim;                                     \
                    float kf[MAX_HEAD_DIM];                                                    \
                    for (int64_t d = 0; d < head_dim; d++) kf[d] = LOAD(krow[d]);              \
                    for (int64_t g = 0; g < group; g++) {                                      \
                        float s = 0.0f;                                                        \
                        for (int64_t d = 0; d < head_dim; d++) s += qf[g][d] * kf[d];          \
                        scores[g * ctx + t0 + j] = s;                                          \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t g = 0; g < group; g++) {                                              \
                float *sc = scores + g * ctx;                                                  \
                float m = -INFINITY, sum = 0.0f;                                               \
                for (int64_t t = 0; t < ctx; t++) m = sc[t] > m ? sc[t] : m;                   \
                for (int64_t t = 0; t < ctx; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }   \
                const float inv = 1.0f / sum;                                                  \
                for (int64_t t = 0; t < ctx; t++) sc[t] *= inv;                                \
            }                                                                                  \
            for (int64_t b = start / block_size; b < nblocks; b++) {                           \
                const int64_t t0 = b * block_size - start;                                     \
                const int64_t rows = end - b * block_size < block_size ? end - b * block_size   \
                                                                       : block_size;           \
                const int64_t j0 = t0 < 0 ? -t0 : 0;                                           \
                const T *vblock = v_cache + (h * slots + table[b] * block_size) * head_dim;    \
                if (b + 1 < nblocks) prefetch_block(                                           \
                    v_cache + (h * slots + table[b + 1] * block_size) * head_dim,              \
                    block_size * head_dim * (int64_t)sizeof(T));                               \
                for (int64_t j = j0; j < rows; j++) {                                          \
                    const T *vrow = vblock + j * head_dim;                                     \
                    float vf[MAX_HEAD_DIM];                                                    \
                    for (int64_t d = 0; d < head_dim; d++) vf[d] = LOAD(vrow[d]);              \
                    for (int64_t g = 0; g < group; g++) {                                      \
                        const float p = scores[g * ctx + t0 + j];                              \
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];         \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t g = 0; g < group; g++) {                                              \
                T *orow = out + (i * heads + h * group + g) * head_dim;                        \
                for (int64_t d = 0; d < head_dim; d++) orow[d] = STORE(acc[g][d]);             \
            }                                                                                  \
            free(scores);                                                                      \
        }                                                                                      \
    }                                                                                          \
    return failed;                                                                             \
}

#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_decode_attention_f32, float, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

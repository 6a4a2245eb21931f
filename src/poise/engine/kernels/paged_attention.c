/* Decode attention straight from the paged KV cache, for the CPU.
 *
 * Each query row attends to its context, read block by block through its block table: each
 * K and V row is read once from the pool, with no gathered copy. Work is split over (run of
 * rows, KV head) pairs, a run being one decode row or a prompt chunk's consecutive rows of one
 * sequence (the deterministic mode sends prompts here); the query heads of one KV head
 * (grouped-query attention) and the rows of a run share each K/V row they read. Scores are
 * kept in float32, softmax is exact (two passes over the scores), and the weighted sum of V
 * accumulates in float32.
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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* Blocks are scattered over the pool, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 1);
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
/* Query heads one task holds: a sequence's consecutive rows times the group (see below). */
#define MAX_MEMBERS 16

/* Runs of consecutive rows that are one sequence's consecutive positions (the same block table
 * and start, each row's context one longer than the last): a prompt chunk in the deterministic
 * mode. A task takes up to MAX_MEMBERS / group rows of a run, so the K and V rows they share are
 * read once for all of them; each row's own sums still run exactly as they would alone (the
 * same loops, in the same order), so a row's result does not depend on its run. */
static int64_t find_runs(const int64_t *block_tables, const int64_t *context_lens,
                         const int64_t *context_starts, int64_t n, int64_t max_blocks,
                         int64_t max_rows, int64_t *run_first) {
    int64_t runs = 0;
    for (int64_t i = 0; i < n; i++) {
        int joins = i > 0 && i - run_first[runs - 1] < max_rows &&
                    context_lens[i] == context_lens[i - 1] + 1 &&
                    (!context_starts || context_starts[i] == context_starts[i - 1]) &&
                    memcmp(block_tables + i * max_blocks, block_tables + (i - 1) * max_blocks,
                           sizeof(int64_t) * max_blocks) == 0;
        if (!joins) run_first[runs++] = i;
    }
    run_first[runs] = n;
    return runs;
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                     \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,          \
         const int64_t *context_lens, const int64_t *context_starts, T *out, int64_t n, int64_t heads, int64_t kv_heads,      \
         int64_t head_dim, int64_t slots, int64_t block_size, int64_t max_blocks, float scale,  \
         int num_threads) {                                                                    \
    const int64_t group = heads / kv_heads;                                                    \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return 1;                                \
    int64_t *run_first = malloc(sizeof(int64_t) * (n + 1));                                   \
    if (!run_first) return 1;                                                                  \
    const int64_t runs = find_runs(block_tables, context_lens, context_starts, n, max_blocks,  \
                                   MAX_MEMBERS / group, run_first);                            \
    int failed = 0;                                                                            \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")      \
    for (int64_t u = 0; u < runs; u++) {                                                       \
        for (int64_t h = 0; h < kv_heads; h++) {                                               \
            const int64_t i0 = run_first[u], rows_here = run_first[u + 1] - i0;                \
            const int64_t members = rows_here * group;                                         \
            const int64_t start = context_starts ? context_starts[i0] : 0;                     \
            const int64_t last_end = context_lens[i0 + rows_here - 1];                         \
            const int64_t width = last_end - start; /* the longest row's context */            \
            float qf[MAX_MEMBERS][MAX_HEAD_DIM];                                               \
            float acc[MAX_MEMBERS][MAX_HEAD_DIM];                                              \
            float *scores = malloc(sizeof(float) * members * (width > 0 ? width : 1));         \
            if (!scores) { failed = 1; continue; }                                             \
            for (int64_t m = 0; m < members; m++) {                                            \
                const int64_t i = i0 + m / group, g = m % group;                               \
                const T *qrow = q + (i * heads + h * group + g) * head_dim;                    \
                for (int64_t d = 0; d < head_dim; d++) qf[m][d] = LOAD(qrow[d]) * scale;       \
                for (int64_t d = 0; d < head_dim; d++) acc[m][d] = 0.0f;                       \
            }                                                                                  \
            const int64_t *table = block_tables + i0 * max_blocks;                             \
            const int64_t nblocks = (last_end + block_size - 1) / block_size;                  \
            for (int64_t b = start / block_size; b < nblocks; b++) {                           \
                const int64_t t0 = b * block_size - start; /* may be < 0 in the first block */ \
                const int64_t rows = last_end - b * block_size < block_size                    \
                                         ? last_end - b * block_size : block_size;             \
                const int64_t j0 = t0 < 0 ? -t0 : 0;                                           \
                const T *kblock = k_cache + (h * slots + table[b] * block_size) * head_dim;    \
                if (b + 1 < nblocks) prefetch_block(                                           \
                    k_cache + (h * slots + table[b + 1] * block_size) * head_dim,              \
                    block_size * head_dim * (int64_t)sizeof(T));                               \
                for (int64_t j = j0; j < rows; j++) {                                          \
                    const T *krow = kblock + j * head_dim;                                     \
                    const int64_t pos = b * block_size + j;                                    \
                    float kf[MAX_HEAD_DIM];                                                    \
                    for (int64_t d = 0; d < head_dim; d++) kf[d] = LOAD(krow[d]);              \
                    /* The rows whose context holds pos: all but the first few. */             \
                    const int64_t first = pos < context_lens[i0] ? 0 : pos - context_lens[i0] + 1; \
                    for (int64_t m = first * group; m < members; m++) {                        \
                        float s = 0.0f;                                                        \
                        for (int64_t d = 0; d < head_dim; d++) s += qf[m][d] * kf[d];          \
                        scores[m * width + t0 + j] = s;                                        \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t m = 0; m < members; m++) {                                            \
                const int64_t ctx = context_lens[i0 + m / group] - start;                      \
                float *sc = scores + m * width;                                                \
                float mx = -INFINITY, sum = 0.0f;                                              \
                for (int64_t t = 0; t < ctx; t++) mx = sc[t] > mx ? sc[t] : mx;                \
                for (int64_t t = 0; t < ctx; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }  \
                const float inv = 1.0f / sum;                                                  \
                for (int64_t t = 0; t < ctx; t++) sc[t] *= inv;                                \
            }                                                                                  \
            for (int64_t b = start / block_size; b < nblocks; b++) {                           \
                const int64_t t0 = b * block_size - start;                                     \
                const int64_t rows = last_end - b * block_size < block_size                    \
                                         ? last_end - b * block_size : block_size;             \
                const int64_t j0 = t0 < 0 ? -t0 : 0;                                           \
                const T *vblock = v_cache + (h * slots + table[b] * block_size) * head_dim;    \
                if (b + 1 < nblocks) prefetch_block(                                           \
                    v_cache + (h * slots + table[b + 1] * block_size) * head_dim,              \
                    block_size * head_dim * (int64_t)sizeof(T));                               \
                for (int64_t j = j0; j < rows; j++) {                                          \
                    const T *vrow = vblock + j * head_dim;                                     \
                    const int64_t pos = b * block_size + j;                                    \
                    float vf[MAX_HEAD_DIM];                                                    \
                    for (int64_t d = 0; d < head_dim; d++) vf[d] = LOAD(vrow[d]);              \
                    const int64_t first = pos < context_lens[i0] ? 0 : pos - context_lens[i0] + 1; \
                    for (int64_t m = first * group; m < members; m++) {                        \
                        const float p = scores[m * width + t0 + j];                            \
                        for (int64_t d = 0; d < head_dim; d++) acc[m][d] += p * vf[d];         \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t m = 0; m < members; m++) {                                            \
                const int64_t i = i0 + m / group, g = m % group;                               \
                T *orow = out + (i * heads + h * group + g) * head_dim;                        \
                for (int64_t d = 0; d < head_dim; d++) orow[d] = STORE(acc[m][d]);             \
            }                                                                                  \
            free(scores);                                                                      \
        }                                                                                      \
    }                                                                                          \
    free(run_first);                                                                           \
    return failed;                                                                             \
}

#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_decode_attention_f32, float, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Kernels of translation on a CPU.
 *
 * nmt_best_tokens: the search's choice of each decoder row's best next tokens (beams.best_tokens) in one call: for
 * every row of logits, its log-sum-exp, its k largest logits other than PAD and BOS (best first;
 * equal ones by lower index) as log-probabilities, and the log-probability of EOS.
 *
 * torch needs a log_softmax over the whole row and a top-k on its result, each a pass over all N x V
 * values with its own threads and temporaries; here each row is read three times while it is in the
 * cache: its maximum (by blocks of BLOCK), the sum of exp(x - max), and the k largest, looked for only
 * in the blocks whose maximum reaches the k-th largest block maximum (the k best lie there).
 *
 * nmt_cached_attention: incremental decoding's attention of one step over the cached keys and values
 * (kernels.cached_attention), one pass over each head's cache, where torch runs two batched products of
 * tiny matrices (and in bf16 sets up a new oneDNN primitive for every new cache length).
 *
 * nmt_quantize_rows, nmt_int8_scale: the elementwise work on either side of an int8 matrix product
 * (int8.py), one pass each where torch runs several operations.
 *
 * Compiled by native.py with the machine's own instructions (-march=native); the loops are written
 * for the compiler to vectorize (OpenMP simd reductions, an exp it can inline).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64

/* exp(x) for x <= 0, within 2 float ulp: exp(x) = 2^n exp(r), r = x - n log 2 in [-log 2 / 2, log 2 / 2],
 * exp(r) by its degree-7 Taylor-like polynomial (Cephes' expf coefficients); x below -87 (where exp
 * underflows float's normal range) gives exp(-87), which adds nothing to a sum holding exp(0) = 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* log 2 in two parts, for exact n log 2 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n as a float */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* A bfloat16 is the high half of the float32 it rounds. */
static inline float bf16_float(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* bfloat16 values widened to float32. */
static inline void widen(const uint16_t *half, int64_t n, float *to) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) to[i] = bf16_float(half[i]);
}

/* Element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as a float32. */
static inline float element(const void *values, int64_t i, int bf16) {
    return bf16 ? bf16_float(((const uint16_t *)values)[i]) : ((const float *)values)[i];
}

/* Put (x, i) into the k best so far (sorted, best first) if it beats the last; returns the new last. */
static inline float enter(float *top, int64_t *tokens, int64_t k, float x, int64_t i) {
    int64_t j = k - 1;
    while (j > 0 && top[j - 1] < x) {
        top[j] = top[j - 1];
        tokens[j] = tokens[j - 1];
        j--;
    }
    top[j] = x;
    tokens[j] = i;
    return top[k - 1];
}

static void best_of_row(const float *row, int64_t V, int64_t k, int64_t pad, int64_t bos, int64_t eos,
                        float *top, int64_t *tokens, float *eos_log_prob, float *block_max) {
    int64_t blocks = (V + BLOCK - 1) / BLOCK;
    float max = -INFINITY;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = b * BLOCK; i < end; i++) m = row[i] > m ? row[i] : m;
        block_max[b] = m;
        max = m > max ? m : max;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < V; i++) sum += exp_nonpositive(row[i] - max);
    float log_sum_exp = max + logf(sum);

    /* The k-th largest maximum of the blocks without PAD or BOS: each such maximum is a candidate,
     * so the k best candidates are at least as large, and a block whose maximum is smaller holds none. */
    int64_t pad_block = pad / BLOCK, bos_block = bos / BLOCK;
    for (int64_t j = 0; j < k; j++) top[j] = -INFINITY, tokens[j] = pad;
    float last = -INFINITY;
    for (int64_t b = 0; b < blocks; b++)
        if (b != pad_block && b != bos_block && block_max[b] > last) last = enter(top, tokens, k, block_max[b], b);
    float least = last;
    for (int64_t j = 0; j < k; j++) top[j] = -INFINITY, tokens[j] = pad;
    last = -INFINITY;
    for (int64_t b = 0; b < blocks; b++) {
        if (block_max[b] < least && b != pad_block && b != bos_block) continue;
        int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
        for (int64_t i = b * BLOCK; i < end; i++)
            if (row[i] > last && i != pad && i != bos) last = enter(top, tokens, k, row[i], i);
    }
    for (int64_t j = 0; j < k; j++) top[j] -= log_sum_exp;
    *eos_log_prob = row[eos] - log_sum_exp;
}

/* logits: N rows of V, float32 (bf16 = 0) or bfloat16 (bf16 = 1), contiguous. Writes top (N, k) float32,
 * tokens (N, k) int64, eos_log_prob (N,) float32. Returns 0, or -1 if memory ran out. */
int nmt_best_tokens(const void *logits, int bf16, int64_t N, int64_t V, int64_t k, int64_t pad, int64_t bos,
                    int64_t eos, float *top, int64_t *tokens, float *eos_log_prob) {
    float *block_max = malloc(sizeof(float) * ((V + BLOCK - 1) / BLOCK));
    float *row = bf16 ? malloc(sizeof(float) * V) : NULL;
    if (!block_max || (bf16 && !row)) {
        free(block_max);
        free(row);
        return -1;
    }
    for (int64_t n = 0; n < N; n++) {
        if (bf16)
            widen((const uint16_t *)logits + n * V, V, row);
        best_of_row(bf16 ? row : (const float *)logits + n * V, V, k, pad, bos, eos, top + n * k,
                    tokens + n * k, eos_log_prob + n, block_max);
    }
    free(block_max);
    free(row);
    return 0;
}

/* nmt_cached_attention: incremental decoding's attention over cached keys and values
 * (kernels.cached_attention), softmax(q k^T * scale) v in float32, for each of G groups and H heads: T
 * queries q (G, H, T, K) over L cached keys k (G, H, L, K) and values v (G, H, L, Kv), keys l of group g
 * left out where allowed[g * L + l] is 0 (allowed may be NULL; a group has at least one key allowed):
 * neither read nor multiplied, so a row that joined a search late, or a short sentence padded to a
 * long one, costs what its own keys cost.
 * With rows (G, L) (may be NULL), k (P, H, K) and v (P, H, Kv) are pools of entries instead, and group
 * g's key and value l are entry rows[g * L + l] (the self-attention cache of transformer.Cache).
 * A group is a decoder row (self-attention: T = 1, its own cache) or a sentence (cross-attention: its
 * T beams over its one copy of the encoder's keys and values). out (G, T, H, Kv): the heads side by
 * side, as W^O reads them. All contiguous, float32 (bf16 = 0) or bfloat16 (bf16 = 1; out rounded to
 * nearest even). Returns 0, or -1 if memory ran out. */
static inline __attribute__((always_inline)) int cached_attention(
    const void *q, const void *k, const void *v, const uint8_t *allowed, const int64_t *rows, int64_t G,
    int64_t H, int64_t T, int64_t L, int64_t K, int64_t Kv, float scale, void *out, int bf16) {
    float *qh = malloc(sizeof(float) * (T * K + T * L + T * Kv));
    if (!qh)
        return -1;
    float *scores = qh + T * K, *sum = scores + T * L;
    for (int64_t g = 0; g < G; g++) {
        for (int64_t h = 0; h < H; h++) {
            int64_t head = g * H + h, kh = head * L * K, vh = head * L * Kv;
            const int64_t *entry = rows ? rows + g * L : NULL; /* key l at (entry[l] * H + h) * K */
#pragma omp simd
            for (int64_t i = 0; i < T * K; i++) qh[i] = element(q, head * T * K + i, bf16);
            for (int64_t t = 0; t < T; t++) {
                float *s = scores + t * L, max = -INFINITY, total = 0.0f;
                for (int64_t l = 0; l < L; l++) {
                    if (allowed && !allowed[g * L + l]) { /* no dot product: its weight is 0 */
                        s[l] = -INFINITY;
                        continue;
                    }
                    float part[16] = {0}; /* 16 partial sums, in vector registers; K % 16 == 0 */
                    int64_t key = entry ? (entry[l] * H + h) * K : kh + l * K;
                    for (int64_t i = 0; i < K; i += 16)
#pragma omp simd
                        for (int64_t j = 0; j < 16; j++) part[j] += qh[t * K + i + j] * element(k, key + i + j, bf16);
                    float dot = 0.0f;
                    for (int64_t j = 0; j < 16; j++) dot += part[j];
                    s[l] = dot * scale;
                }
#pragma omp simd reduction(max : max)
                for (int64_t l = 0; l < L; l++) max = s[l] > max ? s[l] : max;
#pragma omp simd reduction(+ : total)
                for (int64_t l = 0; l < L; l++) { /* -inf: exp(-87), about 1.6e-38, then 0 below */
                    s[l] = exp_nonpositive(s[l] - max);
                    total += s[l];
                }
                float inverse = 1.0f / total, *acc = sum + t * Kv;
                for (int64_t i = 0; i < Kv; i += 16) { /* 16 outputs at a time, in registers; Kv % 16 == 0 */
                    float block[16] = {0};
                    for (int64_t l = 0; l < L; l++) {
                        if (allowed && !allowed[g * L + l]) /* weight 0: adding nothing is exact */
                            continue;
                        float w = s[l] * inverse;
                        int64_t value = entry ? (entry[l] * H + h) * Kv : vh + l * Kv;
#pragma omp simd
                        for (int64_t j = 0; j < 16; j++) block[j] += w * element(v, value + i + j, bf16);
                    }
                    for (int64_t j = 0; j < 16; j++) acc[i + j] = block[j];
                }
                int64_t at = ((g * T + t) * H + h) * Kv;
                if (!bf16) {
                    memcpy((float *)out + at, acc, sizeof(float) * Kv);
                    continue;
                }
                uint16_t *half = (uint16_t *)out + at;
#pragma omp simd
                for (int64_t i = 0; i < Kv; i++) {
                    uint32_t bits;
                    memcpy(&bits, &acc[i], sizeof bits);
                    half[i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
                }
            }
        }
    }
    free(qh);
    return 0;
}

int nmt_cached_attention(const void *q, const void *k, const void *v, const uint8_t *allowed,
                         const int64_t *rows, int bf16, int64_t G, int64_t H, int64_t T, int64_t L, int64_t K,
                         int64_t Kv, float scale, void *out) {
    /* two copies, each with its element type fixed, for the compiler to vectorize */
    return bf16 ? cached_attention(q, k, v, allowed, rows, G, H, T, L, K, Kv, scale, out, 1)
                : cached_attention(q, k, v, allowed, rows, G, H, T, L, K, Kv, scale, out, 0);
}

/* nmt_quantize_rows: int8 translation's input side (int8.quantize_rows) in one pass over each row of
 * x (N, K) float32: its scale, max(max |x|, FLT_MIN) / 127, into scale[n], and x / scale rounded to the
 * nearest integer, ties to even (as torch rounds), into q (N, K) int8. torch takes six operations and
 * two temporaries for it. The values are torch's exactly: the same division, the same rounding. */
void nmt_quantize_rows(const float *x, int64_t N, int64_t K, int8_t *q, float *scale) {
    for (int64_t n = 0; n < N; n++) {
        const float *row = x + n * K;
        float most = 0.0f;
#pragma omp simd reduction(max : most)
        for (int64_t i = 0; i < K; i++) most = fabsf(row[i]) > most ? fabsf(row[i]) : most;
        float s = (most > 1.17549435e-38f ? most : 1.17549435e-38f) / 127.0f;
        scale[n] = s;
#pragma omp simd
        for (int64_t i = 0; i < K; i++) {
            float r = rintf(row[i] / s); /* |r| <= 127 by the scale's choice; a NaN gives 0 */
            q[n * K + i] = (int8_t)(r >= -127.0f && r <= 127.0f ? r : 0.0f);
        }
    }
}

/* nmt_int8_scale: int8 translation's output side: out (N, M) float32 = acc (N, M), the exact int32
 * products, times each output channel's weight scale wscale (M,) and each row's input scale
 * xscale (N,), plus bias (M,) if not NULL, then max(0, .) if relu (the feed-forward's first layer);
 * one pass where torch makes a float copy, scales it twice and applies the relu. */
void nmt_int8_scale(const int32_t *acc, int64_t N, int64_t M, const float *wscale, const float *xscale,
                    const float *bias, int relu, float *out) {
    for (int64_t n = 0; n < N; n++) {
        const int32_t *a = acc + n * M;
        float *o = out + n * M, xs = xscale[n];
        if (bias) {
#pragma omp simd
            for (int64_t m = 0; m < M; m++) o[m] = bias[m] + (float)a[m] * wscale[m] * xs;
        } else {
#pragma omp simd
            for (int64_t m = 0; m < M; m++) o[m] = (float)a[m] * wscale[m] * xs;
        }
        if (relu) {
#pragma omp simd
            for (int64_t m = 0; m < M; m++) o[m] = o[m] > 0.0f ? o[m] : 0.0f;
        }
    }
}

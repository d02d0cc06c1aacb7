/* Fused fp32 CPU kernels for the fast decode step (fast_decode.py), built and loaded by cpu_kernels.py.
 *
 * In eager PyTorch a decode step's element-wise work is ~20 small ops per layer, each paying for cold
 * caches after a GEMM has streamed its weights through them; here it is two calls per layer:
 *   rms_scaled:       out[r] = x[r] / sqrt(mean(x[r]^2) + eps)                      (RMSNorm, no weight)
 *   decode_attention: per (row b, kv head h): rotate the new k and the group's q heads (rope, the
 *                     halves convention: x_i c_i - x_{i+D/2} s_i, x_{i+D/2} c_i + x_i s_i; q also times
 *                     the attention scaling), write k and v into cache column length-1, then for each
 *                     q head softmax(q K^T over the unmasked columns) V.
 *   residual_rms:     h += y in place, out = rms_scaled(h)            (a residual add and the next norm)
 *   silu_mul:         out[r, i] = silu(x[r, i]) * x[r, n + i]           (the MLP's gate|up output)
 * All parallelise over rows with OpenMP (the process's libgomp, which torch loaded) using the
 * `threads` the caller passes (torch.get_num_threads()).
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 32  /* query heads per kv head (cpu_kernels.MAX_GROUP) */
#define MAX_HEAD_DIM 256  /* (cpu_kernels.MAX_HEAD_DIM) */

static void scale_row(const float *x, float *out, int64_t n, float eps) {
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale;
}

void rms_scaled(const float *x, float *out, int64_t rows, int64_t n, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) scale_row(x + r * n, out + r * n, n, eps);
}

void residual_rms(float *h, const float *y, float *out, int64_t rows, int64_t n, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n;
        const float *yr = y + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) hr[i] += yr[i];
        scale_row(hr, out + r * n, n, eps);
    }
}

/* e^x for finite x, vectorisable: x = k ln2 + r (|r| <= ln2 / 2, ln2 split in a high part exact in float
 * and a low part), e^r by its degree-7 Taylor polynomial (truncation < 1e-8 relative), times 2^k built in
 * the exponent bits; 0 below -87.3, where 2^k would leave the normal range. */
static inline float exp_f32(float x) {
    float xc = x > 88.0f ? 88.0f : x;
    xc = xc < -88.0f ? -88.0f : xc;
    const float k = nearbyintf(xc * 1.44269504088896341f);
    const float r = (xc - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } two_k;
    two_k.i = ((int32_t)k + 127) << 23;
    return x < -87.3f ? 0.f : p * two_k.f;
}

void silu_mul(const float *x, float *out, int64_t rows, int64_t n, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.f + exp_f32(-gate[i])) * up[i];
    }
}

static void rotate(const float *x, const float *c, const float *s, float scale, int64_t half, float *out) {
    for (int64_t i = 0; i < half; i++) {
        out[i] = (x[i] * c[i] - x[i + half] * s[i]) * scale;
        out[i + half] = (x[i + half] * c[i] + x[i] * s[i]) * scale;
    }
}

/* qkv: [B, hkv, group + 2, D] (per kv head: its group's q heads, k, v); cos, sin: [B, D/2];
 * keys, values: [B, hkv, capacity, D], columns 0..length-1 used after this call (length-1 is written);
 * mask: int64 [B, >= length] with row stride mask_stride (0 = never attended); scores: scratch of
 * B * hkv * group * length floats; out: [B, hkv * group, D] (query head h * group + j). */
int decode_attention(const float *qkv, const float *cos, const float *sin, float scaling,
                     float *keys, float *values, int64_t capacity, int64_t length,
                     const int64_t *mask, int64_t mask_stride, float *scores, float *out,
                     int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim, int threads) {
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % 2 || length < 1 || length > capacity)
        return 1;
    const int64_t half = head_dim / 2, D = head_dim;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads;
        const float *src = qkv + task * (group + 2) * D, *c = cos + b * half, *s = sin + b * half;
        const int64_t *m = mask + b * mask_stride;
        float *K = keys + task * capacity * D, *V = values + task * capacity * D;
        rotate(src + group * D, c, s, 1.0f, half, K + (length - 1) * D);
        for (int64_t i = 0; i < D; i++) V[(length - 1) * D + i] = src[(group + 1) * D + i];

        float q[MAX_GROUP * MAX_HEAD_DIM];
        for (int64_t j = 0; j < group; j++) rotate(src + j * D, c, s, scaling, half, q + j * D);
        float *p = scores + task * group * length;  /* [length][group] */
        float top[MAX_GROUP], total[MAX_GROUP];
        for (int64_t j = 0; j < group; j++) { top[j] = -INFINITY; total[j] = 0.f; }
        for (int64_t l = 0; l < length; l++) {
            if (!m[l]) continue;
            const float *k = K + l * D;
            for (int64_t j = 0; j < group; j++) {
                const float *qj = q + j * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t i = 0; i < D; i++) dot += qj[i] * k[i];
                p[l * group + j] = dot;
                if (dot > top[j]) top[j] = dot;
            }
        }
        float *o = out + task * group * D;
        for (int64_t i = 0; i < group * D; i++) o[i] = 0.f;
        for (int64_t l = 0; l < length; l++) {
            if (!m[l]) continue;
            const float *v = V + l * D;
            for (int64_t j = 0; j < group; j++) {
                const float w = expf(p[l * group + j] - top[j]);
                total[j] += w;
                float *oj = o + j * D;
                #pragma omp simd
                for (int64_t i = 0; i < D; i++) oj[i] += w * v[i];
            }
        }
        for (int64_t j = 0; j < group; j++) {
            const float inv = 1.0f / total[j];  /* total >= 1: the new column is always attended */
            float *oj = o + j * D;
            #pragma omp simd
            for (int64_t i = 0; i < D; i++) oj[i] *= inv;
        }
    }
    return 0;
}

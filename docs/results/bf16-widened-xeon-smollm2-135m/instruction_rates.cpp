// vdpbf16ps against vfmadd231ps on this CPU, and whether two multiply-adds (the odd pair's product, then the even's)
// give vdpbf16ps's bits.  Rates: independent chains of each instruction (8-32 accumulators, so that no chain waits on
// its own latency), ns per instruction.  Bits: 1,600,000 sums of an fp32 accumulator and two bf16 pair products, the
// inputs normally distributed.
//
//   g++ -O3 -o instruction_rates instruction_rates.cpp && ./instruction_rates
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
template<int C> __attribute__((target("avx512f,avx512bw,avx512bf16"))) double run_bf(long n){  // ns per vdpbf16ps
  __m512 s[C]; for(int i=0;i<C;i++) s[i]=_mm512_setzero_ps();
  __m512i a=_mm512_set1_epi32(0x3f803f80), b=_mm512_set1_epi32(0x3f803f80);
  auto t=std::chrono::steady_clock::now();
  for(long i=0;i<n;i++){ _Pragma("GCC unroll 32") for(int j=0;j<C;j++) s[j]=_mm512_dpbf16_ps(s[j],(__m512bh)a,(__m512bh)b); __asm__ volatile("" : "+v"(a)); }
  double d=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  float f=0; for(int i=0;i<C;i++) f+=_mm512_reduce_add_ps(s[i]); if(f==1) printf("x");
  return d/n/C*1e9;
}
template<int C> __attribute__((target("avx512f"))) double run_fma(long n){  // ns per vfmadd231ps
  __m512 s[C]; for(int i=0;i<C;i++) s[i]=_mm512_setzero_ps();
  __m512 a=_mm512_set1_ps(1.0001f), b=_mm512_set1_ps(0.9999f);
  auto t=std::chrono::steady_clock::now();
  for(long i=0;i<n;i++){ _Pragma("GCC unroll 32") for(int j=0;j<C;j++) s[j]=_mm512_fmadd_ps(a,b,s[j]); __asm__ volatile("" : "+v"(a)); }
  double d=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  float f=0; for(int i=0;i<C;i++) f+=_mm512_reduce_add_ps(s[i]); if(f==1) printf("x");
  return d/n/C*1e9;
}
static float bf(uint16_t h){ uint32_t u=uint32_t(h)<<16; float f; memcpy(&f,&u,4); return f; }
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void check(){
  std::mt19937 g(1); std::normal_distribution<float> nd(0,1);
  int mism_oe=0, mism_eo=0, N=100000;
  for(int t=0;t<N;t++){
    uint32_t aw[16], bw[16]; float acc[16], out[16];
    for(int i=0;i<16;i++){ float x=nd(g), y=nd(g), z=nd(g), w=nd(g); uint32_t ux,uy,uz,uw; memcpy(&ux,&x,4);memcpy(&uy,&y,4);memcpy(&uz,&z,4);memcpy(&uw,&w,4);
      aw[i]=(ux>>16)|(uy&0xffff0000u); bw[i]=(uz>>16)|(uw&0xffff0000u); acc[i]=nd(g)*4; }
    __m512 r=_mm512_dpbf16_ps(_mm512_loadu_ps(acc),(__m512bh)_mm512_loadu_si512(aw),(__m512bh)_mm512_loadu_si512(bw));
    _mm512_storeu_ps(out,r);
    for(int i=0;i<16;i++){
      float e0=bf(aw[i]&0xffff)*bf(bw[i]&0xffff), e1=bf(aw[i]>>16)*bf(bw[i]>>16);
      float oe=(acc[i]+e1)+e0, eo=(acc[i]+e0)+e1;
      mism_oe += oe!=out[i]; mism_eo += eo!=out[i];
    }
  }
  printf("mismatch odd-then-even %d, even-then-odd %d of %d\n", mism_oe, mism_eo, N*16);
}
int main(){
  long n=50000000; check();
  for(int r=0;r<2;r++){
    printf("vdpbf16ps   chains 8: %.3f  12: %.3f  24: %.3f  32: %.3f ns/instr\n", run_bf<8>(n), run_bf<12>(n), run_bf<24>(n), run_bf<32>(n));
    printf("vfmadd231ps chains 8: %.3f  12: %.3f  24: %.3f  32: %.3f ns/instr\n", run_fma<8>(n), run_fma<12>(n), run_fma<24>(n), run_fma<32>(n));
  }
}

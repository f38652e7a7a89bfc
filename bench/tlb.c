/* Random 4K copies out of (reads) and streaming stores into (writes) a 1 GiB region, on 4K or huge
 * pages: what a TLB miss costs a memory volume on this machine (docs/benchmarks.md, "Memory
 * volumes on huge pages").  gcc -O2 -o /tmp/tlb bench/tlb.c && /tmp/tlb 0 && /tmp/tlb 1 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <emmintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t sz=1UL<<30; int huge=atoi(argv[1]);
  char*p=mmap(0,sz+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  p=(char*)(((unsigned long)p+(2<<20)-1)&~((2UL<<20)-1));
  madvise(p,sz,huge?MADV_HUGEPAGE:MADV_NOHUGEPAGE);
  memset(p,1,sz);
  char buf[4096] __attribute__((aligned(64))); memset(buf,2,4096);
  unsigned long x=88172645463325252UL; int n=1000000;
  for(int mode=0;mode<2;mode++){
  double t=now();
  for(int i=0;i<n;i++){x^=x<<13;x^=x>>7;x^=x<<17; size_t off=(x%(sz/4096))*4096;
    if(mode==0) memcpy(buf,p+off,4096); else { for(int k=0;k<4096;k+=16) _mm_stream_si128((__m128i*)(p+off+k), _mm_load_si128((__m128i*)(buf+k))); _mm_sfence(); } }
  printf("huge=%d %s: %.1f ns per 4K\n",huge,mode?"write(nt)":"read",(now()-t)/n*1e9);}
  return 0;}

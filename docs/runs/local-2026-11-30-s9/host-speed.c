#include <stdio.h>
#include <time.h>
int main(){ volatile unsigned long x=0; for(int r=0;r<40;r++){ struct timespec a,b; clock_gettime(CLOCK_MONOTONIC,&a); for(unsigned long i=0;i<50000000;i++) x+=i; clock_gettime(CLOCK_MONOTONIC,&b); printf("%.1f ", (b.tv_sec-a.tv_sec)*1e3+(b.tv_nsec-a.tv_nsec)/1e6); fflush(stdout);} printf("\n"); }

#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <stdlib.h>
static double chunk(unsigned long n){ volatile unsigned long x=0; struct timespec a,b; clock_gettime(CLOCK_MONOTONIC,&a); for(unsigned long i=0;i<n;i++) x+=i; clock_gettime(CLOCK_MONOTONIC,&b); return (b.tv_sec-a.tv_sec)*1e3+(b.tv_nsec-a.tv_nsec)/1e6;}
int main(int argc,char**argv){ int gaps[]={0,10,50,100,300,1000,3000};
 for(int g=0; g<7; g++){ for(int r=0;r<60;r++) chunk(10000000); /* warm ~1-5s */
   double w=chunk(10000000); usleep(gaps[g]*1000); double s[8]; for(int k=0;k<8;k++) s[k]=chunk(10000000);
   printf("gap %4d ms: warm %.1f after:", gaps[g], w); for(int k=0;k<8;k++) printf(" %.1f", s[k]); printf("\n"); fflush(stdout);} }

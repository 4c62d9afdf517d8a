/* launcher/main.c: placeholder while the trainer is written. */
#include <stdio.h>
int main(void) { puts("moe-dist: not yet"); return 1; }

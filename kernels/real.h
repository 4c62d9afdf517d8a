/* kernels/real.h: the element type of the CPU reference.
 * The reference is written once against `real` and compiled twice: as float (the
 * library the program links) and, with -DMOE_REAL_DOUBLE, as double (the library the
 * finite-difference tests link, so gradients are checked in double precision). */
#ifndef MOE_KERNELS_REAL_H
#define MOE_KERNELS_REAL_H
#ifdef MOE_REAL_DOUBLE
typedef double real;
#else
typedef float real;
#endif
#endif

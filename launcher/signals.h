/* launcher/signals.h: SIGUSR1 and SIGTERM ask the run to checkpoint and stop.
 *
 * The handler only stores the signal number in a flag (async-signal-safe); the trainer
 * reads the flag at each step boundary, the world agrees (a signal to any one rank
 * counts), writes a checkpoint and stops; the launcher then exits with
 * MOE_EXIT_REQUEUE (75, EX_TEMPFAIL) so a batch script can requeue the job.
 * Owns: the handlers and the flag. Does not own: what the trainer does about it. */
#ifndef MOE_LAUNCHER_SIGNALS_H
#define MOE_LAUNCHER_SIGNALS_H

#include <signal.h>

/* The exit status after a signal-triggered checkpoint: requeue and resume. */
#define MOE_EXIT_REQUEUE 75

/* Installs the handlers (SA_RESTART). Returns 0, or -1 after printing why. */
int moe_signals_install(void);

/* The flag: 0, or the number of the last signal received. */
volatile sig_atomic_t *moe_signals_flag(void);

#endif

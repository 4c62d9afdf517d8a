/* launcher/signals.c: SIGUSR1/SIGTERM -> a flag (see signals.h). */
#include "launcher/signals.h"

#include <stdio.h>
#include <string.h>

static volatile sig_atomic_t stop_flag;

static void on_signal(int signo) { stop_flag = signo; }

int moe_signals_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    if (sigemptyset(&sa.sa_mask) != 0 || sigaction(SIGUSR1, &sa, NULL) != 0 ||
        sigaction(SIGTERM, &sa, NULL) != 0) {
        perror("moe-dist: cannot install the SIGUSR1/SIGTERM handlers");
        return -1;
    }
    return 0;
}

volatile sig_atomic_t *moe_signals_flag(void) { return &stop_flag; }

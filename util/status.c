/* util/status.c: status names and the "host:rank" message prefix. */
#include "util/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static char log_host[64];
static int log_rank = -1;

const char *moe_status_str(moe_status st)
{
    switch (st) {
    case MOE_OK: return "ok";
    case MOE_ERR_INVALID: return "invalid input";
    case MOE_ERR_IO: return "i/o error";
    case MOE_ERR_NOMEM: return "out of memory";
    case MOE_ERR_COMM: return "communication error";
    case MOE_ERR_DEVICE: return "device error";
    case MOE_ERR_NUMERIC: return "non-finite values";
    }
    return "unknown error";
}

void moe_log_set_rank(int rank) { log_rank = rank; }

static void log_prefix(void)
{
    if (log_host[0] == '\0' && gethostname(log_host, sizeof log_host - 1) != 0)
        strcpy(log_host, "?");
    if (log_rank >= 0)
        fprintf(stderr, "%s:%d: ", log_host, log_rank);
    else
        fprintf(stderr, "%s:?: ", log_host);
}

void moe_log(const char *fmt, ...)
{
    va_list ap;
    log_prefix();
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

void moe_log_at(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    log_prefix();
    fprintf(stderr, "%s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

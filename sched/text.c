/* sched/text.c: line reader and strict number parsing for sched/'s text files. */
#include "sched/text.h"

#include <stdarg.h>

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

moe_status moe_text_error(const char *src_file, int src_line, const moe_text_reader *r,
                          const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->lineno > 0)
        moe_log_at(src_file, src_line, "%s %s:%d: %s", r->what, r->path, r->lineno, msg);
    else
        moe_log_at(src_file, src_line, "%s %s: %s", r->what, r->path, msg);
    return MOE_ERR_INVALID;
}

moe_status moe_text_open(moe_text_reader *r, const char *path, const char *what)
{
    memset(r, 0, sizeof *r);
    r->path = path;
    r->what = what;
    r->f = fopen(path, "r");
    if (!r->f)
        MOE_FAIL(MOE_ERR_IO, "cannot open %s %s: %s", what, path, strerror(errno));
    return MOE_OK;
}

int moe_text_next(moe_text_reader *r)
{
    for (;;) {
        errno = 0;
        ssize_t n = getline(&r->line, &r->cap, r->f);
        if (n < 0) {
            if (ferror(r->f)) {
                moe_log_at(__FILE__, __LINE__, "%s: read error after line %d: %s", r->path,
                           r->lineno, strerror(errno ? errno : EIO));
                return -1;
            }
            return 0;
        }
        r->lineno++;
        while (n > 0 && (r->line[n - 1] == '\n' || r->line[n - 1] == '\r'))
            r->line[--n] = '\0';
        const char *p = r->line;
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p != '\0' && *p != '#')
            return 1;
    }
}

void moe_text_close(moe_text_reader *r)
{
    if (r->f)
        fclose(r->f);
    free(r->line);
    r->f = NULL;
    r->line = NULL;
    r->cap = 0;
}

static const char *skip_blanks(const char *p)
{
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

int moe_text_int64(const char **p, int64_t *out)
{
    const char *s = skip_blanks(*p);
    if (!(isdigit((unsigned char)*s) || ((*s == '-' || *s == '+') && isdigit((unsigned char)s[1]))))
        return 0;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno == ERANGE || (*end != '\0' && *end != ' ' && *end != '\t' && *end != ':'))
        return 0;
    *out = (int64_t)v;
    *p = end;
    return 1;
}

int moe_text_word(const char **p, const char *word)
{
    const char *s = skip_blanks(*p);
    size_t n = strlen(word);
    if (strncmp(s, word, n) != 0 || (s[n] != '\0' && s[n] != ' ' && s[n] != '\t' && s[n] != ':'))
        return 0;
    *p = s + n;
    return 1;
}

int moe_text_char(const char **p, char c)
{
    const char *s = skip_blanks(*p);
    if (*s != c)
        return 0;
    *p = s + 1;
    return 1;
}

int moe_text_at_end(const char *p) { return *skip_blanks(p) == '\0'; }

const char *moe_text_excerpt(const char *p)
{
    static _Thread_local char buf[32];
    p = skip_blanks(p);
    size_t n = 0;
    while (p[n] != '\0' && n < 24) {
        buf[n] = isprint((unsigned char)p[n]) ? p[n] : '?';
        n++;
    }
    buf[n] = '\0';
    if (p[n] != '\0' && n >= 3)
        memcpy(buf + n - 3, "...", 4);
    return buf;
}

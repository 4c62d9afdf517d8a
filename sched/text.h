/* sched/text.h: the line reader and number parsing shared by the scheduler's text files
 * (routing_stats, placement plans). Internal to sched/.
 *
 * Owns: reading a file line by line with line numbers, skipping blank and '#' lines, and
 * strict integer and keyword parsing. Does not own: what the lines mean. */
#ifndef MOE_SCHED_TEXT_H
#define MOE_SCHED_TEXT_H

#include <stdint.h>
#include <stdio.h>

#include "util/status.h"

typedef struct {
    FILE *f;
    const char *path;
    char *line;       /* the current line, without its newline */
    size_t cap;       /* bytes allocated for line */
    int lineno;       /* 1-based number of the current line */
    const char *what; /* the kind of file, for messages ("plan file") */
} moe_text_reader;

/* Logs "<what> path:line: message" (or "<what> path: message" before the first line) at
 * the caller's file:line; returns MOE_ERR_INVALID. */
moe_status moe_text_error(const char *src_file, int src_line, const moe_text_reader *r,
                          const char *fmt, ...) __attribute__((format(printf, 4, 5)));
#define MOE_TEXT_BAD(r, ...) moe_text_error(__FILE__, __LINE__, (r), __VA_ARGS__)

/* Opens `path` for reading; `what` names the kind of file in the error ("plan file").
 * MOE_ERR_IO when it cannot be opened, naming it and the reason. */
moe_status moe_text_open(moe_text_reader *r, const char *path, const char *what);

/* Moves to the next line that is neither blank nor a '#' comment. Returns 1 with r->line
 * set, 0 at the end of the file, -1 on a read error (logged, naming the file). */
int moe_text_next(moe_text_reader *r);

/* Closes the file and frees the line; closing twice does nothing. */
void moe_text_close(moe_text_reader *r);

/* Skips blanks and parses one decimal integer that ends at a blank, a ':' or the end of
 * the text. Returns 1 and advances *p, or 0 (nothing, not a number, out of range). */
int moe_text_int64(const char **p, int64_t *out);

/* Skips blanks and consumes `word` if it comes next, followed by a blank, a ':' or the
 * end of the text. Returns 1 if consumed, else 0. */
int moe_text_word(const char **p, const char *word);

/* Skips blanks and consumes the character c if it comes next. Returns 1 if consumed. */
int moe_text_char(const char **p, char c);

/* 1 if only blanks remain at p. */
int moe_text_at_end(const char *p);

/* A short, printable excerpt of the text at p (for messages): at most 24 characters. */
const char *moe_text_excerpt(const char *p);

#endif

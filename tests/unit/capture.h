/* tests/unit/capture.h: capture what a call writes to stderr (the messages of
 * moe_log), for tests that check error messages. Include after <cmocka.h>. */
#ifndef MOE_TESTS_CAPTURE_H
#define MOE_TESTS_CAPTURE_H

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int saved_fd = -1;
static FILE *capture_file;
static char captured[16384];

static void capture_begin(void)
{
    fflush(stderr);
    capture_file = tmpfile();
    assert_non_null(capture_file);
    saved_fd = dup(2);
    assert_true(saved_fd >= 0);
    assert_true(dup2(fileno(capture_file), 2) >= 0);
}

/* Restores stderr; the text written meanwhile is in `captured` (and echoed, for logs). */
static const char *capture_end(void)
{
    fflush(stderr);
    dup2(saved_fd, 2);
    close(saved_fd);
    rewind(capture_file);
    size_t n = fread(captured, 1, sizeof captured - 1, capture_file);
    captured[n] = '\0';
    fclose(capture_file);
    fprintf(stderr, "    [captured] %s", captured);
    return captured;
}

static void assert_has(const char *text, const char *needle)
{
    if (!strstr(text, needle))
        fail_msg("expected \"%s\" in the message: %s", needle, text);
}

#endif

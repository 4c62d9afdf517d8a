/* tests/unit/tmpdir.h: a test program's temporary folder, made before a group of tests
 * and removed with everything in it after the group:
 *   cmocka_run_group_tests(tests, setup_dir, remove_dir);
 * The tests write under tmpdir (/tmp/moe_test.XXXXXX, from mkdtemp). */
#ifndef MOE_TESTS_TMPDIR_H
#define MOE_TESTS_TMPDIR_H

#include <stdio.h>
#include <stdlib.h>

static char tmpdir[256];

static int setup_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/moe_test.XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

#endif

/* runtime/checkpoint.c: save, resume, inspect and export of checkpoints (see
 * checkpoint.h for the layout and docs/checkpoints.md for users).
 *
 * Save: every rank that writes (world rank 0: dense tensors; world ranks < ep: the slices
 * of their experts) writes rank-RRRRR.bin into the temporary directory and fsyncs it;
 * the world agrees that all did (a sum of failure flags, which is also the barrier); each
 * rank packs its part of the manifest (its slices and file) and rank 0 gathers the
 * parts, writes manifest.pb and COMMITTED, fsyncs, renames, fsyncs the parent, prunes.
 *
 * Read: a reader checks COMMITTED, then manifest.pb's size and CRC-32C against it,
 * unpacks the manifest and checks its structure (file names, sizes, offsets inside the
 * files) before any slice is read, so a damaged manifest can never send a read astray.
 * Each slice read is checked against its CRC-32C. */
#define _GNU_SOURCE /* nftw */
#include "runtime/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.pb-c.h"
#include "comm/comm.h"
#include "kernels/backend.h"
#include "util/crc32c.h"

#define CKPT_FORMAT_VERSION 1
#define MARKER_NAME "COMMITTED"
#define MANIFEST_NAME "manifest.pb"
#define MARKER_MAGIC "moe-dist checkpoint"
#define MAX_MANIFEST_BYTES (1u << 30)
#define PATH_CAP 2048
#define N_KINDS 3

static const char *const kind_names[N_KINDS] = {"param", "adam_m", "adam_v"};

uint64_t moe_fnv1a64(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

/* ---- files ----------------------------------------------------------------------- */

static moe_status write_all(int fd, const void *data, size_t n, const char *path)
{
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            MOE_FAIL(MOE_ERR_IO, "cannot write '%s': %s", path, strerror(w < 0 ? errno : EIO));
        p += w;
        n -= (size_t)w;
    }
    return MOE_OK;
}

/* Reads n bytes at offset; a short read is a truncated file. */
static moe_status pread_all(int fd, void *data, size_t n, uint64_t offset, const char *path)
{
    char *p = data;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)offset);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            MOE_FAIL(MOE_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
        if (r == 0)
            MOE_FAIL(MOE_ERR_IO, "%s: truncated (ends before byte %" PRIu64 ")", path,
                     offset + (uint64_t)n);
        p += r;
        n -= (size_t)r;
        offset += (uint64_t)r;
    }
    return MOE_OK;
}

static moe_status fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        MOE_FAIL(MOE_ERR_IO, "cannot open directory '%s' to sync it: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int err = errno;
    close(fd);
    if (rc != 0)
        MOE_FAIL(MOE_ERR_IO, "cannot fsync directory '%s': %s", dir, strerror(err));
    return MOE_OK;
}

/* Ends the file written through fd: fsyncs it where st is MOE_OK (its writes succeeded),
 * then closes it. Returns st where that failed already, else the first of the fsync and
 * the close to fail (logged), else MOE_OK. */
static moe_status sync_close(int fd, const char *path, moe_status st)
{
    if (st == MOE_OK && fsync(fd) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot fsync '%s': %s", path, strerror(errno));
        st = MOE_ERR_IO;
    }
    if (close(fd) != 0 && st == MOE_OK) {
        moe_log_at(__FILE__, __LINE__, "cannot close '%s': %s", path, strerror(errno));
        st = MOE_ERR_IO;
    }
    return st;
}

/* Writes a whole file (created or truncated), fsyncs and closes it. */
static moe_status write_file_synced(const char *path, const void *data, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        MOE_FAIL(MOE_ERR_IO, "cannot create '%s': %s", path, strerror(errno));
    return sync_close(fd, path, write_all(fd, data, n, path));
}

/* Reads a whole file of at most max bytes into a malloc'ed buffer (NUL-terminated). */
static moe_status read_file(const char *path, size_t max, char **out, size_t *n)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        MOE_FAIL(MOE_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    moe_status st = MOE_OK;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot stat '%s': %s", path, strerror(errno));
        st = MOE_ERR_IO;
    } else if ((uint64_t)sb.st_size > max) {
        moe_log_at(__FILE__, __LINE__, "'%s': %lld bytes, more than the %zu expected", path,
                   (long long)sb.st_size, max);
        st = MOE_ERR_IO;
    } else if (!(buf = malloc((size_t)sb.st_size + 1))) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate %lld bytes", (long long)sb.st_size);
        st = MOE_ERR_NOMEM;
    } else {
        st = pread_all(fd, buf, (size_t)sb.st_size, 0, path);
        buf[sb.st_size] = '\0';
        *n = (size_t)sb.st_size;
    }
    close(fd);
    if (st != MOE_OK) {
        free(buf);
        return st;
    }
    *out = buf;
    return MOE_OK;
}

static int rm_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(path);
}

static moe_status remove_tree(const char *path)
{
    if (nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT)
        MOE_FAIL(MOE_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
    return MOE_OK;
}

/* mkdir -p */
static moe_status make_dirs(const char *dir)
{
    char p[PATH_CAP];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        MOE_FAIL(MOE_ERR_INVALID, "path too long: '%s'", dir);
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST)
                MOE_FAIL(MOE_ERR_IO, "cannot create directory '%s': %s", p, strerror(errno));
            *s = c;
            if (c == '\0')
                break;
        }
    }
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        MOE_FAIL(MOE_ERR_IO, "'%s' is not a directory", dir);
    return MOE_OK;
}

/* "step-00000042" -> 42; -1 for any other name. */
static int64_t step_of_name(const char *name, const char *prefix)
{
    size_t np = strlen(prefix);
    if (strncmp(name, prefix, np) != 0)
        return -1;
    const char *d = name + np;
    size_t nd = strlen(d);
    if (nd < 8 || nd > 18)
        return -1;
    int64_t v = 0;
    for (size_t i = 0; i < nd; i++) {
        if (d[i] < '0' || d[i] > '9')
            return -1;
        v = v * 10 + (d[i] - '0');
    }
    return v;
}

static int cmp_desc(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Steps of the directories named prefix + digits in dir, newest first. committed_only:
 * those holding a COMMITTED file. A missing dir is no steps. */
static moe_status list_steps(const char *dir, const char *prefix, int committed_only,
                             int64_t **steps, int *n)
{
    *steps = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT)
            return MOE_OK;
        MOE_FAIL(MOE_ERR_IO, "cannot list '%s': %s", dir, strerror(errno));
    }
    int cap = 0;
    moe_status st = MOE_OK;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int64_t s = step_of_name(e->d_name, prefix);
        if (s < 0)
            continue;
        if (committed_only) {
            char marker[PATH_CAP];
            struct stat sb;
            snprintf(marker, sizeof marker, "%s/%s/%s", dir, e->d_name, MARKER_NAME);
            if (stat(marker, &sb) != 0)
                continue;
        }
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t *grown = realloc(*steps, sizeof(int64_t) * (size_t)cap);
            if (!grown) {
                moe_log_at(__FILE__, __LINE__, "cannot list '%s': out of memory", dir);
                st = MOE_ERR_NOMEM;
                break;
            }
            *steps = grown;
        }
        (*steps)[(*n)++] = s;
    }
    closedir(d);
    if (st != MOE_OK) {
        free(*steps);
        *steps = NULL;
        *n = 0;
        return st;
    }
    if (*n > 1)
        qsort(*steps, (size_t)*n, sizeof(int64_t), cmp_desc);
    return MOE_OK;
}

static void step_path(char *buf, size_t cap, const char *dir, const char *prefix, int64_t step)
{
    snprintf(buf, cap, "%s/%s%08lld", dir, prefix, (long long)step);
}

/* ---- agreement between ranks ------------------------------------------------------- */

/* Every rank learns whether any failed: returns the local status where it failed, else
 * MOE_ERR_INVALID if any rank had that (a config problem), else MOE_ERR_IO. Collective. */
static moe_status agree(struct moe_comm *comm, moe_status local)
{
    if (!comm)
        return local;
    int64_t v[2] = {local != MOE_OK, local == MOE_ERR_INVALID};
    MOE_CHECK(moe_comm_sum_int64(comm, MOE_GROUP_WORLD, v, 2));
    if (local != MOE_OK)
        return local;
    if (v[0] == 0)
        return MOE_OK;
    return v[1] ? MOE_ERR_INVALID : MOE_ERR_IO;
}

/* ---- host staging of backend memory -------------------------------------------------- */

static void to_host(const moe_model *m, void *dst, const void *src, size_t nbytes)
{
    if (m->be && m->be->on_device)
        m->be->copy(dst, src, nbytes, MOE_COPY_D2H);
    else
        memcpy(dst, src, nbytes);
}

static void to_backend(const moe_model *m, void *dst, const void *src, size_t nbytes)
{
    if (m->be && m->be->on_device)
        m->be->copy(dst, src, nbytes, MOE_COPY_H2D);
    else
        memcpy(dst, src, nbytes);
}

/* ---- save ------------------------------------------------------------------------------ */

/* The slices one rank writes and describes: its part of the manifest. */
typedef struct {
    Moeckpt__TensorSlice *slices;
    Moeckpt__TensorSlice **slice_ptrs;
    int64_t *shapes; /* 3 per slice */
    int n, cap;
    Moeckpt__FileEntry file;
    Moeckpt__FileEntry *file_ptr;
    char file_name[32];
} ckpt_part;

static void part_free(ckpt_part *p)
{
    free(p->slices);
    free(p->slice_ptrs);
    free(p->shapes);
}

/* Does this rank write tensor t? Dense: world rank 0; experts: the first EP group. */
static int writes_tensor(const moe_tensor *t, int rank, int ep)
{
    return t->is_expert ? rank < ep : rank == 0;
}

/* Appends a slice to the part; data is written by the caller. */
static moe_status part_add(ckpt_part *p, const moe_tensor *t, int expert, int kind, uint64_t offset,
                           uint64_t nbytes, uint32_t crc)
{
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 64;
        Moeckpt__TensorSlice *s = realloc(p->slices, sizeof *s * (size_t)cap);
        if (s)
            p->slices = s;
        int64_t *sh = realloc(p->shapes, sizeof *sh * 3 * (size_t)cap);
        if (sh)
            p->shapes = sh;
        if (!s || !sh)
            MOE_FAIL(MOE_ERR_NOMEM, "cannot grow the checkpoint manifest part");
        p->cap = cap;
    }
    Moeckpt__TensorSlice *s = &p->slices[p->n];
    moeckpt__tensor_slice__init(s);
    s->name = (char *)t->name;
    s->layer = t->layer;
    s->expert = expert;
    s->kind = (Moeckpt__TensorKind)kind;
    int64_t *shape = p->shapes + 3 * (size_t)p->n;
    int first = t->is_expert ? 1 : 0;
    s->n_shape = 0;
    for (int d = first; d < t->ndim; d++)
        shape[s->n_shape++] = t->shape[d];
    s->dtype = sizeof(real) == 8 ? MOECKPT__DTYPE__F64 : MOECKPT__DTYPE__F32;
    s->file = p->file_name;
    s->offset = offset;
    s->nbytes = nbytes;
    s->crc32c = crc;
    p->n++;
    return MOE_OK;
}

/* Writes this rank's slices to dir/rank-RRRRR.bin (fsync'ed) and describes them in part.
 * Shapes point into part->shapes, fixed up once the part is complete. */
static moe_status write_rank_file(const char *dir, int rank, int ep, const moe_model *m,
                                  const moe_optimizer *opt, const moe_fault *fault, int64_t step,
                                  ckpt_part *part)
{
    /* the parameters from their arena; the moments through the optimizer (fp32 or bf16) */
    char path[PATH_CAP + 64];
    snprintf(part->file_name, sizeof part->file_name, "rank-%05d.bin", rank);
    snprintf(path, sizeof path, "%s/%s", dir, part->file_name);
    size_t biggest = 0, total_slices = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        if (!writes_tensor(t, rank, ep))
            continue;
        size_t per = t->is_expert ? t->count / (size_t)m->El : t->count;
        biggest = per > biggest ? per : biggest;
        total_slices += N_KINDS * (t->is_expert ? (size_t)m->El : 1);
    }
    real *stage = malloc(sizeof(real) * (biggest ? biggest : 1));
    if (!stage)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %zu bytes to stage the checkpoint",
                 sizeof(real) * biggest);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        free(stage);
        MOE_FAIL(MOE_ERR_IO, "cannot create '%s': %s", path, strerror(errno));
    }
    moe_status st = MOE_OK;
    uint64_t offset = 0;
    size_t written = 0;
    for (int i = 0; i < m->n_tensors && st == MOE_OK; i++) {
        const moe_tensor *t = &m->tensors[i];
        if (!writes_tensor(t, rank, ep))
            continue;
        int parts = t->is_expert ? m->El : 1;
        size_t per = t->count / (size_t)parts;
        for (int k = 0; k < N_KINDS && st == MOE_OK; k++) {
            for (int e = 0; e < parts && st == MOE_OK; e++) {
                size_t nbytes = sizeof(real) * per;
                const size_t at = t->offset + (size_t)e * per;
                if (k == 0)
                    to_host(m, stage, m->params + at, nbytes);
                else
                    st = moe_optimizer_read(opt, k - 1, at, per, stage);
                if (st != MOE_OK)
                    break;
                uint32_t crc = moe_crc32c(0, stage, nbytes);
                st = write_all(fd, stage, nbytes, path);
                if (st == MOE_OK)
                    st = part_add(part, t,
                                  t->is_expert ? moe_model_local_experts(m, t->layer)[e] : -1, k,
                                  offset, nbytes, crc);
                offset += nbytes;
                if (fault && ++written == (total_slices + 1) / 2)
                    moe_fault_ckpt_point(fault, rank, (int)step);
            }
        }
    }
    st = sync_close(fd, path, st);
    free(stage);
    MOE_CHECK(st);
    moeckpt__file_entry__init(&part->file);
    part->file.name = part->file_name;
    part->file.nbytes = offset;
    part->file.writer_rank = rank;
    part->file_ptr = &part->file;
    return MOE_OK;
}

/* Packs a part (its slices and file; nothing else) to a malloc'ed buffer. */
static moe_status pack_part(ckpt_part *p, int has_file, uint8_t **out, size_t *n)
{
    Moeckpt__Manifest mf = MOECKPT__MANIFEST__INIT;
    *out = NULL;
    p->slice_ptrs = malloc(sizeof *p->slice_ptrs * (size_t)(p->n ? p->n : 1));
    if (!p->slice_ptrs)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot pack the manifest part");
    for (int i = 0; i < p->n; i++) {
        p->slices[i].shape = p->shapes + 3 * (size_t)i;
        p->slice_ptrs[i] = &p->slices[i];
    }
    mf.n_tensors = (size_t)p->n;
    mf.tensors = p->slice_ptrs;
    if (has_file) {
        mf.n_files = 1;
        mf.files = &p->file_ptr;
    }
    *n = moeckpt__manifest__get_packed_size(&mf);
    *out = malloc(*n ? *n : 1);
    if (!*out)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot pack the manifest part");
    moeckpt__manifest__pack(&mf, *out);
    return MOE_OK;
}

/* Rank 0: merges the gathered parts with the global fields, writes manifest.pb and
 * COMMITTED into tmp, then renames tmp to final and syncs the parent. */
static moe_status commit(const moe_config *cfg, int world, const moe_model *m,
                         const moe_optimizer *opt, const moe_ckpt_state *state, const char *tmp,
                         const char *final, const uint8_t *parts, const size_t *sizes)
{
    moe_status st = MOE_OK;
    Moeckpt__Manifest **unpacked = calloc((size_t)world, sizeof *unpacked);
    Moeckpt__TensorSlice **slices = NULL;
    Moeckpt__FileEntry **files = NULL;
    Moeckpt__LayerPlacement *place = NULL, **place_ptrs = NULL;
    char *ini = NULL;
    uint8_t *packed = NULL;
    if (!unpacked)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot merge the manifest");
    size_t n_slices = 0, n_files = 0, at = 0;
    for (int r = 0; r < world; r++) {
        unpacked[r] = moeckpt__manifest__unpack(NULL, sizes[r], parts + at);
        at += sizes[r];
        if (!unpacked[r]) {
            moe_log_at(__FILE__, __LINE__, "cannot unpack the manifest part of rank %d", r);
            st = MOE_ERR_COMM;
            goto fail;
        }
        n_slices += unpacked[r]->n_tensors;
        n_files += unpacked[r]->n_files;
    }
    const int n_moe = m->L - cfg->dense_layers;
    slices = malloc(sizeof *slices * (n_slices ? n_slices : 1));
    files = malloc(sizeof *files * (n_files ? n_files : 1));
    place = calloc((size_t)(n_moe > 0 ? n_moe : 1), sizeof *place);
    place_ptrs = calloc((size_t)(n_moe > 0 ? n_moe : 1), sizeof *place_ptrs);
    size_t ini_len = moe_config_to_ini(cfg, NULL, 0);
    ini = malloc(ini_len + 1);
    if (!slices || !files || !place || !place_ptrs || !ini) {
        moe_log_at(__FILE__, __LINE__, "cannot merge the manifest");
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    moe_config_to_ini(cfg, ini, ini_len + 1);
    n_slices = n_files = 0;
    for (int r = 0; r < world; r++) {
        for (size_t i = 0; i < unpacked[r]->n_tensors; i++)
            slices[n_slices++] = unpacked[r]->tensors[i];
        for (size_t i = 0; i < unpacked[r]->n_files; i++)
            files[n_files++] = unpacked[r]->files[i];
    }
    for (int l = 0; l < n_moe; l++) {
        moeckpt__layer_placement__init(&place[l]);
        place[l].layer = cfg->dense_layers + l;
        place[l].n_expert_rank = (size_t)m->E;
        place[l].expert_rank = (int32_t *)moe_model_expert_rank(m, cfg->dense_layers + l);
        place_ptrs[l] = &place[l];
    }
    Moeckpt__Manifest mf = MOECKPT__MANIFEST__INIT;
    mf.format_version = CKPT_FORMAT_VERSION;
    mf.moe_version = (char *)MOE_VERSION;
    mf.step = state->step;
    mf.config_ini = ini;
    mf.config_hash = moe_fnv1a64(ini, ini_len);
    mf.consumed = state->consumed;
    mf.seed = cfg->seed;
    mf.data_seed = cfg->data_seed;
    mf.loss_scale_mode = state->loss_scale_dynamic ? MOECKPT__LOSS_SCALE_MODE__DYNAMIC
                                                   : MOECKPT__LOSS_SCALE_MODE__NONE;
    mf.loss_scale = state->loss_scale_dynamic ? state->loss_scale : 1.0;
    mf.loss_scale_good_steps = state->loss_scale_good;
    mf.optimizer_t = opt->t;
    mf.world_size = world;
    mf.ep = m->ep;
    mf.n_placement = (size_t)(n_moe > 0 ? n_moe : 0);
    mf.placement = place_ptrs;
    mf.n_files = n_files;
    mf.files = files;
    mf.n_tensors = n_slices;
    mf.tensors = slices;
    mf.wall_time = (double)time(NULL);
    mf.dtype_bytes = (int32_t)sizeof(real);
    size_t n = moeckpt__manifest__get_packed_size(&mf);
    packed = malloc(n ? n : 1);
    if (!packed) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate %zu bytes for the manifest", n);
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    moeckpt__manifest__pack(&mf, packed);

    char path[PATH_CAP + 64], marker[256];
    snprintf(path, sizeof path, "%s/%s", tmp, MANIFEST_NAME);
    MOE_CHECK_GOTO(st, write_file_synced(path, packed, n));
    int mlen = snprintf(marker, sizeof marker,
                        "%s\nstep %lld\nmanifest_bytes %zu\nmanifest_crc32c 0x%08" PRIx32 "\n",
                        MARKER_MAGIC, (long long)state->step, n, moe_crc32c(0, packed, n));
    snprintf(path, sizeof path, "%s/%s", tmp, MARKER_NAME);
    MOE_CHECK_GOTO(st, write_file_synced(path, marker, (size_t)mlen));
    MOE_CHECK_GOTO(st, fsync_dir(tmp));
    struct stat sb;
    if (stat(final, &sb) == 0) { /* a save of this step from an abandoned timeline */
        moe_log("checkpoint: replacing the existing '%s'", final);
        MOE_CHECK_GOTO(st, remove_tree(final));
    }
    if (rename(tmp, final) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot rename '%s' to '%s': %s", tmp, final,
                   strerror(errno));
        st = MOE_ERR_IO;
        goto fail;
    }
    MOE_CHECK_GOTO(st, fsync_dir(cfg->ckpt_dir));
fail:
    for (int r = 0; r < world; r++)
        if (unpacked[r])
            moeckpt__manifest__free_unpacked(unpacked[r], NULL);
    free(unpacked);
    free(slices);
    free(files);
    free(place);
    free(place_ptrs);
    free(ini);
    free(packed);
    return st;
}

/* Rank 0: deletes committed checkpoints beyond the newest `keep`. */
static moe_status prune(const char *dir, int keep)
{
    int64_t *steps = NULL;
    int n = 0;
    MOE_CHECK(list_steps(dir, "step-", 1, &steps, &n));
    moe_status st = MOE_OK;
    for (int i = keep; i < n && st == MOE_OK; i++) {
        char path[PATH_CAP];
        step_path(path, sizeof path, dir, "step-", steps[i]);
        st = remove_tree(path);
    }
    free(steps);
    return st;
}

/* Rank 0: creates dir, removes leftovers of interrupted saves, creates tmp. */
static moe_status prepare_dir(const char *dir, const char *tmp)
{
    MOE_CHECK(make_dirs(dir));
    int64_t *steps = NULL;
    int n = 0;
    MOE_CHECK(list_steps(dir, ".tmp-step-", 0, &steps, &n));
    moe_status st = MOE_OK;
    for (int i = 0; i < n && st == MOE_OK; i++) {
        char path[PATH_CAP];
        step_path(path, sizeof path, dir, ".tmp-step-", steps[i]);
        st = remove_tree(path);
    }
    free(steps);
    MOE_CHECK(st);
    if (mkdir(tmp, 0755) != 0)
        MOE_FAIL(MOE_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    return MOE_OK;
}

moe_status moe_checkpoint_save(const moe_config *cfg, struct moe_comm *comm, const moe_model *m,
                               const moe_optimizer *opt, const moe_ckpt_state *state,
                               const moe_fault *fault, char *path, size_t cap)
{
    const int rank = comm ? moe_comm_rank(comm, MOE_GROUP_WORLD) : 0;
    const int world = comm ? moe_comm_size(comm, MOE_GROUP_WORLD) : 1;
    char tmp[PATH_CAP], final[PATH_CAP];
    ckpt_part part = {0};
    uint8_t *packed = NULL, *parts = NULL;
    size_t n_packed = 0, *sizes = NULL;
    moe_status st = MOE_OK;
    if (strlen(cfg->ckpt_dir) + 32 > sizeof tmp)
        MOE_FAIL(MOE_ERR_INVALID, "[checkpoint] dir is too long");
    step_path(tmp, sizeof tmp, cfg->ckpt_dir, ".tmp-step-", state->step);
    step_path(final, sizeof final, cfg->ckpt_dir, "step-", state->step);
    moe_comm_set_context(comm, "checkpoint", -1);

    if (rank == 0)
        st = prepare_dir(cfg->ckpt_dir, tmp);
    MOE_CHECK(agree(comm, st));
    const int writer = rank == 0 || rank < m->ep;
    if (writer)
        st = write_rank_file(tmp, rank, m->ep, m, opt, fault, state->step, &part);
    if (st == MOE_OK)
        st = pack_part(&part, writer, &packed, &n_packed);
    /* the barrier that follows every rank's fsync */
    MOE_CHECK_GOTO(st, agree(comm, st));
    if (comm) {
        if (rank == 0 && !(sizes = malloc(sizeof *sizes * (size_t)world))) {
            moe_log_at(__FILE__, __LINE__, "cannot allocate the gather sizes");
            st = MOE_ERR_NOMEM;
        }
        MOE_CHECK_GOTO(st, agree(comm, st));
        MOE_CHECK_GOTO(st, moe_comm_gather_bytes(comm, packed, n_packed, (void **)&parts, sizes));
    } else {
        parts = packed;
        packed = NULL;
        sizes = malloc(sizeof *sizes);
        if (!sizes) {
            st = MOE_ERR_NOMEM;
            goto fail;
        }
        sizes[0] = n_packed;
    }
    if (rank == 0) {
        st = commit(cfg, world, m, opt, state, tmp, final, parts, sizes);
        if (st == MOE_OK)
            st = prune(cfg->ckpt_dir, cfg->ckpt_keep);
    }
    MOE_CHECK_GOTO(st, agree(comm, st));
    if (path)
        snprintf(path, cap, "%s", final);
fail:
    moe_comm_set_context(comm, NULL, -1);
    part_free(&part);
    free(packed);
    free(parts);
    free(sizes);
    return st;
}

/* ---- reading ------------------------------------------------------------------------- */

typedef struct {
    char dir[PATH_CAP];
    Moeckpt__Manifest *mf;
    Moeckpt__TensorSlice **sorted; /* by (name, expert, kind) */
    int *fds;                      /* per manifest file, -1 until opened */
    int *fd_checked;
} ckpt_reader;

static void reader_close(ckpt_reader *r)
{
    if (r->fds)
        for (size_t i = 0; i < r->mf->n_files; i++)
            if (r->fds[i] >= 0)
                close(r->fds[i]);
    free(r->fds);
    free(r->fd_checked);
    free(r->sorted);
    if (r->mf)
        moeckpt__manifest__free_unpacked(r->mf, NULL);
    memset(r, 0, sizeof *r);
}

static int cmp_slice(const void *a, const void *b)
{
    const Moeckpt__TensorSlice *x = *(Moeckpt__TensorSlice *const *)a;
    const Moeckpt__TensorSlice *y = *(Moeckpt__TensorSlice *const *)b;
    int c = strcmp(x->name, y->name);
    if (c)
        return c;
    if (x->expert != y->expert)
        return x->expert < y->expert ? -1 : 1;
    return (int)x->kind - (int)y->kind;
}

static int file_index(const Moeckpt__Manifest *mf, const char *name)
{
    for (size_t i = 0; i < mf->n_files; i++)
        if (strcmp(mf->files[i]->name, name) == 0)
            return (int)i;
    return -1;
}

/* A tensor file name: "rank-" + 5 digits + ".bin", nothing else (no path). */
static int valid_file_name(const char *s)
{
    if (strncmp(s, "rank-", 5) != 0 || strlen(s) != 14 || strcmp(s + 10, ".bin") != 0)
        return 0;
    for (int i = 5; i < 10; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* Structure of an unpacked manifest: what every later read relies on. */
static moe_status validate_manifest(const ckpt_reader *r)
{
    const Moeckpt__Manifest *mf = r->mf;
    const char *dir = r->dir;
    if (mf->format_version != CKPT_FORMAT_VERSION)
        MOE_FAIL(MOE_ERR_IO, "%s/%s: format version %u, this moe-dist reads %d", dir, MANIFEST_NAME,
                 mf->format_version, CKPT_FORMAT_VERSION);
    if (mf->step < 0 || mf->consumed < 0 || mf->optimizer_t < 0 || mf->world_size < 1 ||
        mf->ep < 1 || (mf->dtype_bytes != 4 && mf->dtype_bytes != 8))
        MOE_FAIL(MOE_ERR_IO, "%s/%s: invalid step, data position, world or dtype", dir,
                 MANIFEST_NAME);
    for (size_t i = 0; i < mf->n_files; i++) {
        if (!valid_file_name(mf->files[i]->name))
            MOE_FAIL(MOE_ERR_IO, "%s/%s: invalid tensor file name '%.40s'", dir, MANIFEST_NAME,
                     mf->files[i]->name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(mf->files[i]->name, mf->files[j]->name) == 0)
                MOE_FAIL(MOE_ERR_IO, "%s/%s: file %s listed twice", dir, MANIFEST_NAME,
                         mf->files[i]->name);
    }
    for (size_t i = 0; i < mf->n_tensors; i++) {
        const Moeckpt__TensorSlice *s = mf->tensors[i];
        int f = file_index(mf, s->file);
        uint64_t elem = s->dtype == MOECKPT__DTYPE__F64 ? 8 : 4, count = 1;
        int ok = f >= 0 && s->n_shape >= 1 && s->n_shape <= 3 && s->kind >= 0 &&
                 s->kind < N_KINDS &&
                 (s->dtype == MOECKPT__DTYPE__F32 || s->dtype == MOECKPT__DTYPE__F64) &&
                 s->name[0] != '\0' && strlen(s->name) < MOE_TENSOR_NAME_MAX && s->expert >= -1;
        for (size_t d = 0; ok && d < s->n_shape; d++) {
            ok = s->shape[d] > 0 && s->shape[d] <= (int64_t)1 << 31;
            count *= ok ? (uint64_t)s->shape[d] : 1;
        }
        ok = ok && count <= (UINT64_C(1) << 40) && s->nbytes == count * elem;
        ok = ok && s->offset <= mf->files[f]->nbytes &&
             s->nbytes <= mf->files[f]->nbytes - s->offset;
        if (!ok)
            MOE_FAIL(MOE_ERR_IO,
                     "%s/%s: slice %zu (%.64s) is inconsistent (file, shape, size or offset)", dir,
                     MANIFEST_NAME, i, s->name);
    }
    return MOE_OK;
}

/* Opens checkpoint directory `dir`: COMMITTED, then manifest.pb checked against it. */
static moe_status reader_open(ckpt_reader *r, const char *dir)
{
    memset(r, 0, sizeof *r);
    if (snprintf(r->dir, sizeof r->dir, "%s", dir) >= (int)sizeof r->dir)
        MOE_FAIL(MOE_ERR_INVALID, "checkpoint path too long");
    char path[PATH_CAP + 32], *marker = NULL, *buf = NULL;
    size_t n = 0, mn = 0;
    moe_status st = MOE_OK;
    snprintf(path, sizeof path, "%s/%s", dir, MARKER_NAME);
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        MOE_FAIL(MOE_ERR_IO, "%s: no such checkpoint directory", dir);
    if (stat(path, &sb) != 0)
        MOE_FAIL(MOE_ERR_IO, "%s: not committed (no %s marker): an interrupted save?", dir,
                 MARKER_NAME);
    MOE_CHECK(read_file(path, 4096, &marker, &n));
    long long step = -1;
    size_t want = 0;
    unsigned crc = 0;
    int used = 0;
    if (sscanf(marker, MARKER_MAGIC "\nstep %lld\nmanifest_bytes %zu\nmanifest_crc32c %x\n%n",
               &step, &want, &crc, &used) != 3 ||
        (size_t)used != n || want > MAX_MANIFEST_BYTES) {
        moe_log_at(__FILE__, __LINE__, "%s: not a valid commit marker", path);
        free(marker);
        return MOE_ERR_IO;
    }
    free(marker);
    snprintf(path, sizeof path, "%s/%s", dir, MANIFEST_NAME);
    MOE_CHECK(read_file(path, MAX_MANIFEST_BYTES, &buf, &mn));
    if (mn != want) {
        moe_log_at(__FILE__, __LINE__, "%s: %s (%zu bytes, the commit marker says %zu)", path,
                   mn < want ? "truncated" : "too long", mn, want);
        st = MOE_ERR_IO;
    } else if (moe_crc32c(0, buf, mn) != crc) {
        moe_log_at(__FILE__, __LINE__,
                   "%s: CRC32C mismatch (0x%08" PRIx32 ", the commit marker says 0x%08x)", path,
                   moe_crc32c(0, buf, mn), crc);
        st = MOE_ERR_IO;
    } else if (!(r->mf = moeckpt__manifest__unpack(NULL, mn, (const uint8_t *)buf))) {
        moe_log_at(__FILE__, __LINE__, "%s: not a valid manifest", path);
        st = MOE_ERR_IO;
    } else if (r->mf->step != step) {
        moe_log_at(__FILE__, __LINE__, "%s: step %lld, the commit marker says %lld", path,
                   (long long)r->mf->step, step);
        st = MOE_ERR_IO;
    }
    free(buf);
    if (st == MOE_OK)
        st = validate_manifest(r);
    if (st == MOE_OK) {
        size_t nt = r->mf->n_tensors, nf = r->mf->n_files;
        r->sorted = malloc(sizeof *r->sorted * (nt ? nt : 1));
        r->fds = malloc(sizeof *r->fds * (nf ? nf : 1));
        r->fd_checked = calloc(nf ? nf : 1, sizeof *r->fd_checked);
        if (!r->sorted || !r->fds || !r->fd_checked) {
            moe_log_at(__FILE__, __LINE__, "cannot index the manifest");
            st = MOE_ERR_NOMEM;
        } else {
            for (size_t i = 0; i < nf; i++)
                r->fds[i] = -1;
            if (nt)
                memcpy(r->sorted, r->mf->tensors, sizeof *r->sorted * nt);
            if (nt > 1)
                qsort(r->sorted, nt, sizeof *r->sorted, cmp_slice);
            for (size_t i = 1; i < nt && st == MOE_OK; i++)
                if (cmp_slice(&r->sorted[i - 1], &r->sorted[i]) == 0) {
                    moe_log_at(__FILE__, __LINE__, "%s/%s: slice %s expert %d %s listed twice", dir,
                               MANIFEST_NAME, r->sorted[i]->name, r->sorted[i]->expert,
                               kind_names[r->sorted[i]->kind]);
                    st = MOE_ERR_IO;
                }
        }
    }
    if (st != MOE_OK) {
        if (!r->fds && r->mf) {
            moeckpt__manifest__free_unpacked(r->mf, NULL);
            r->mf = NULL;
        }
        reader_close(r);
    }
    return st;
}

static const Moeckpt__TensorSlice *find_slice(const ckpt_reader *r, const char *name, int expert,
                                              int kind)
{
    Moeckpt__TensorSlice key = MOECKPT__TENSOR_SLICE__INIT, *kp = &key;
    key.name = (char *)name;
    key.expert = expert;
    key.kind = (Moeckpt__TensorKind)kind;
    Moeckpt__TensorSlice **hit =
        bsearch(&kp, r->sorted, r->mf->n_tensors, sizeof *r->sorted, cmp_slice);
    return hit ? *hit : NULL;
}

/* Opens a tensor file once and checks its size against the manifest. */
static moe_status reader_fd(ckpt_reader *r, int f, int *fd)
{
    char path[PATH_CAP + 32];
    snprintf(path, sizeof path, "%s/%s", r->dir, r->mf->files[f]->name);
    if (r->fds[f] < 0) {
        r->fds[f] = open(path, O_RDONLY | O_CLOEXEC);
        if (r->fds[f] < 0)
            MOE_FAIL(MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    if (!r->fd_checked[f]) {
        struct stat sb;
        if (fstat(r->fds[f], &sb) != 0)
            MOE_FAIL(MOE_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        if ((uint64_t)sb.st_size != r->mf->files[f]->nbytes)
            MOE_FAIL(MOE_ERR_IO, "%s: %s (%lld bytes, the manifest says %" PRIu64 ")", path,
                     (uint64_t)sb.st_size < r->mf->files[f]->nbytes ? "truncated" : "too long",
                     (long long)sb.st_size, r->mf->files[f]->nbytes);
        r->fd_checked[f] = 1;
    }
    *fd = r->fds[f];
    return MOE_OK;
}

/* Reads a slice (nbytes into dst) and checks its CRC-32C; errors name the file. */
static moe_status read_slice(ckpt_reader *r, const Moeckpt__TensorSlice *s, void *dst)
{
    int f = file_index(r->mf, s->file), fd = -1;
    char path[PATH_CAP + 32];
    snprintf(path, sizeof path, "%s/%s", r->dir, s->file);
    MOE_CHECK(reader_fd(r, f, &fd));
    MOE_CHECK(pread_all(fd, dst, (size_t)s->nbytes, s->offset, path));
    uint32_t crc = moe_crc32c(0, dst, (size_t)s->nbytes);
    if (crc != s->crc32c)
        MOE_FAIL(MOE_ERR_IO,
                 "%s: CRC32C mismatch in %s%s%.0d (%s, the slice at byte %" PRIu64 "): 0x%08" PRIx32
                 ", the manifest says 0x%08" PRIx32,
                 path, s->name, s->expert >= 0 ? " expert " : "", s->expert >= 0 ? s->expert : 0,
                 kind_names[s->kind], s->offset, crc, s->crc32c);
    return MOE_OK;
}

/* ---- resume ---------------------------------------------------------------------------- */

/* The keys that fix the parameter shapes must match the checkpoint's config. */
static moe_status check_model_keys(const moe_config *cfg, const char *ini, const char *dir)
{
    moe_config saved;
    moe_config_defaults(&saved);
    char name[PATH_CAP + 32];
    snprintf(name, sizeof name, "%s/%s (config)", dir, MANIFEST_NAME);
    if (moe_config_load_string(&saved, ini, name) != MOE_OK)
        MOE_FAIL(MOE_ERR_IO, "%s: the stored config does not parse", name);
    struct {
        const char *key;
        int now, then;
    } keys[] = {
        {"vocab_size", cfg->vocab_size, saved.vocab_size},
        {"d_model", cfg->d_model, saved.d_model},
        {"n_layers", cfg->n_layers, saved.n_layers},
        {"n_heads", cfg->n_heads, saved.n_heads},
        {"experts", cfg->experts, saved.experts},
        {"expert_hidden", cfg->expert_hidden, saved.expert_hidden},
        {"dense_layers", cfg->dense_layers, saved.dense_layers},
        {"dense_hidden", cfg->dense_hidden, saved.dense_hidden},
        {"shared_experts", cfg->shared_experts, saved.shared_experts},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (keys[i].now != keys[i].then) {
            moe_log("[model] %s = %d, but checkpoint %s was saved with %s = %d: the model "
                    "shape must match to resume",
                    keys[i].key, keys[i].now, dir, keys[i].key, keys[i].then);
            bad++;
        }
    return bad ? MOE_ERR_INVALID : MOE_OK;
}

/* Host copies of the three arenas, filled from a checkpoint before anything changes. */
typedef struct {
    real *a[N_KINDS];
} staging;

static void staging_free(staging *s)
{
    for (int k = 0; k < N_KINDS; k++)
        free(s->a[k]);
}

/* Reads every slice this rank needs from an open checkpoint into st. */
static moe_status load_slices(ckpt_reader *r, const moe_model *m, staging *sg)
{
    if ((size_t)r->mf->dtype_bytes != sizeof(real))
        MOE_FAIL(MOE_ERR_IO, "%s: saved with %d-byte values, this build uses %zu", r->dir,
                 r->mf->dtype_bytes, sizeof(real));
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        int parts = t->is_expert ? m->El : 1;
        size_t per = t->count / (size_t)parts;
        for (int k = 0; k < N_KINDS; k++) {
            for (int e = 0; e < parts; e++) {
                int expert = t->is_expert ? moe_model_local_experts(m, t->layer)[e] : -1;
                const Moeckpt__TensorSlice *s = find_slice(r, t->name, expert, k);
                if (!s)
                    MOE_FAIL(MOE_ERR_IO, "%s/%s: no slice for %s%s%.0d (%s)", r->dir, MANIFEST_NAME,
                             t->name, expert >= 0 ? " expert " : "", expert >= 0 ? expert : 0,
                             kind_names[k]);
                if (s->nbytes != per * sizeof(real))
                    MOE_FAIL(MOE_ERR_IO,
                             "%s/%s: %s%s%.0d has %" PRIu64 " bytes, the model needs %zu", r->dir,
                             MANIFEST_NAME, t->name, expert >= 0 ? " expert " : "",
                             expert >= 0 ? expert : 0, s->nbytes, per * sizeof(real));
                MOE_CHECK(read_slice(r, s, sg->a[k] + t->offset + (size_t)e * per));
            }
        }
    }
    return MOE_OK;
}

/* One candidate: open, check the config, read everything this rank needs. */
/* At the same ep, the run continues with the placement the checkpoint was saved with
 * (a re-planned one included), so the resumed run is the same computation. At another
 * ep the config's placement stays and experts are re-sharded by global id. */
static moe_status adopt_placement(const Moeckpt__Manifest *mf, moe_model *m)
{
    if (mf->ep != m->ep || mf->n_placement == 0)
        return MOE_OK;
    size_t LE = (size_t)m->L * m->E;
    int *table = malloc(sizeof(int) * LE);
    if (!table)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate a placement");
    memcpy(table, m->expert_rank, sizeof(int) * LE);
    moe_status st = MOE_OK;
    for (size_t i = 0; i < mf->n_placement && st == MOE_OK; i++) {
        const Moeckpt__LayerPlacement *pl = mf->placement[i];
        if (pl->layer < 0 || pl->layer >= m->L || pl->n_expert_rank != (size_t)m->E) {
            moe_log_at(__FILE__, __LINE__, "placement of layer %d in the manifest does not fit",
                       (int)pl->layer);
            st = MOE_ERR_IO;
            break;
        }
        for (int e = 0; e < m->E; e++)
            table[(size_t)pl->layer * m->E + e] = pl->expert_rank[e];
    }
    if (st == MOE_OK)
        st = moe_model_set_placement(m, table);
    free(table);
    return st;
}

static moe_status try_load(const char *dir, const moe_config *cfg, moe_model *m, staging *sg,
                           Moeckpt__Manifest **mf_out, ckpt_reader *r)
{
    *mf_out = NULL;
    MOE_CHECK(reader_open(r, dir));
    moe_status st = check_model_keys(cfg, r->mf->config_ini, dir);
    if (st == MOE_OK)
        st = adopt_placement(r->mf, m);
    if (st == MOE_OK)
        st = load_slices(r, m, sg);
    if (st == MOE_OK)
        *mf_out = r->mf;
    return st;
}

/* Rank 0: the keys whose values differ between the checkpoint's config and this run's
 * (both as INI text of every key), as one warning. */
static void report_config_changes(const char *then, const moe_config *cfg)
{
    size_t len = moe_config_to_ini(cfg, NULL, 0);
    char *now = malloc(len + 1);
    if (!now)
        return;
    moe_config_to_ini(cfg, now, len + 1);
    char changes[1024];
    size_t used = 0;
    changes[0] = '\0';
    char section[64] = "";
    for (const char *a = now; *a;) {
        const char *eol = strchr(a, '\n');
        size_t n = eol ? (size_t)(eol - a) : strlen(a);
        if (n > 2 && a[0] == '[' && n < sizeof section)
            snprintf(section, sizeof section, "%.*s", (int)(n - 2), a + 1);
        const char *eq = memchr(a, '=', n);
        if (a[0] != ';' && a[0] != '[' && eq && eq > a + 1) {
            /* find the same "key = " line inside the same section of `then` */
            char head[96];
            snprintf(head, sizeof head, "\n[%s]\n", section);
            const char *sec = strstr(then, head);
            const char *next = sec ? strstr(sec + 1, "\n[") : NULL;
            size_t klen = (size_t)(eq - a);
            const char *b = sec;
            int same = 0;
            while (b && (!next || b < next)) {
                b = strchr(b + 1, '\n');
                if (!b || (next && b >= next))
                    break;
                if (strncmp(b + 1, a, klen) == 0) {
                    const char *beol = strchr(b + 1, '\n');
                    size_t bn = beol ? (size_t)(beol - b - 1) : strlen(b + 1);
                    same = bn == n && strncmp(b + 1, a, n) == 0;
                    break;
                }
            }
            if (!same && used < sizeof changes - 1) {
                int w =
                    snprintf(changes + used, sizeof changes - used, "%s%s.%.*s", used ? ", " : "",
                             section, (int)(klen > 0 && a[klen - 1] == ' ' ? klen - 1 : klen), a);
                if (w > 0)
                    used += (size_t)w;
            }
        }
        a += n + (eol != NULL);
    }
    if (used)
        moe_log("resuming with config changes (this run's values apply): %s", changes);
    free(now);
}

moe_status moe_checkpoint_resume(const char *spec, const moe_config *cfg, struct moe_comm *comm,
                                 moe_model *m, moe_optimizer *opt, moe_ckpt_state *state,
                                 int *found, char *path, size_t cap)
{
    const int rank = comm ? moe_comm_rank(comm, MOE_GROUP_WORLD) : 0;
    const int is_auto = strcmp(spec, "auto") == 0;
    int64_t *steps = NULL;
    int n = 0;
    moe_status st = MOE_OK;
    staging sg = {{NULL}};
    memset(state, 0, sizeof *state);
    *found = 0;
    if (path && cap)
        path[0] = '\0';
    if (is_auto)
        st = list_steps(cfg->ckpt_dir, "step-", 1, &steps, &n);
    MOE_CHECK(agree(comm, st));
    if (is_auto && n == 0) {
        if (rank == 0)
            moe_log("--resume auto: no committed checkpoint in '%s': starting at step 0",
                    cfg->ckpt_dir);
        free(steps);
        return MOE_OK;
    }
    for (int k = 0; k < N_KINDS && st == MOE_OK; k++)
        if (!(sg.a[k] = malloc(sizeof(real) * (m->n_params ? m->n_params : 1))))
            st = MOE_ERR_NOMEM;
    if (st != MOE_OK)
        moe_log_at(__FILE__, __LINE__, "cannot allocate %zu parameters to stage a checkpoint",
                   m->n_params);
    MOE_CHECK_GOTO(st, agree(comm, st));
    int tries = is_auto ? n : 1;
    st = MOE_ERR_IO;
    for (int i = 0; i < tries; i++) {
        char dir[PATH_CAP];
        if (is_auto)
            step_path(dir, sizeof dir, cfg->ckpt_dir, "step-", steps[i]);
        else
            snprintf(dir, sizeof dir, "%s", spec);
        ckpt_reader r;
        Moeckpt__Manifest *mf = NULL;
        moe_status local = try_load(dir, cfg, m, &sg, &mf, &r);
        st = agree(comm, local);
        if (st == MOE_OK) {
            to_backend(m, m->params, sg.a[0], sizeof(real) * m->n_params);
            for (int k = 1; k < N_KINDS && st == MOE_OK; k++)
                st = moe_optimizer_write(opt, k - 1, 0, m->n_params, sg.a[k]);
            state->step = mf->step;
            state->consumed = mf->consumed;
            state->loss_scale_dynamic = mf->loss_scale_mode == MOECKPT__LOSS_SCALE_MODE__DYNAMIC;
            state->loss_scale = mf->loss_scale > 0 ? mf->loss_scale : 1.0;
            state->loss_scale_good = mf->loss_scale_good_steps;
            opt->t = (int)mf->optimizer_t;
            *found = 1;
            if (path)
                snprintf(path, cap, "%s", dir);
            if (rank == 0) {
                if (mf->world_size != (comm ? moe_comm_size(comm, MOE_GROUP_WORLD) : 1) ||
                    mf->ep != m->ep)
                    moe_log("resuming %s saved at world %d, ep %d: experts re-sharded", dir,
                            mf->world_size, mf->ep);
                report_config_changes(mf->config_ini, cfg);
            }
            reader_close(&r);
            break;
        }
        reader_close(&r);
        if (st == MOE_ERR_INVALID || !is_auto)
            break;
        if (rank == 0)
            moe_log("warning: checkpoint %s is unusable (the message above names the bad "
                    "file)%s",
                    dir, i + 1 < tries ? "; falling back to the previous one" : "");
    }
    if (st != MOE_OK && is_auto && st != MOE_ERR_INVALID && rank == 0)
        moe_log("--resume auto: none of the %d committed checkpoints in '%s' is usable", n,
                cfg->ckpt_dir);
fail:
    staging_free(&sg);
    free(steps);
    return st;
}

/* ---- inspect --------------------------------------------------------------------------- */

static void shape_text(const Moeckpt__TensorSlice *s, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (size_t d = 0; d < s->n_shape && len < cap; d++) {
        int w = snprintf(buf + len, cap - len, "%s%" PRId64, d ? "x" : "", s->shape[d]);
        if (w > 0)
            len += (size_t)w;
    }
}

moe_status moe_checkpoint_inspect(const char *path, FILE *out)
{
    ckpt_reader r;
    MOE_CHECK(reader_open(&r, path));
    const Moeckpt__Manifest *mf = r.mf;
    char when[64] = "?";
    time_t wt = (time_t)mf->wall_time;
    struct tm tmv;
    if (gmtime_r(&wt, &tmv))
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tmv);
    fprintf(out, "checkpoint %s (committed)\n", path);
    fprintf(out, "step %" PRId64 ", data position %" PRId64 " sequences, optimizer t %" PRId64 "\n",
            mf->step, mf->consumed, mf->optimizer_t);
    fprintf(out, "saved by moe-dist %s at %s, world %d, ep %d, %d-byte values\n", mf->moe_version,
            when, mf->world_size, mf->ep, mf->dtype_bytes);
    fprintf(out, "config hash 0x%016" PRIx64 " (FNV-1a 64 of the stored config, %zu bytes)\n",
            mf->config_hash, strlen(mf->config_ini));
    fprintf(out, "rng: seed %" PRIu64 ", data seed %" PRIu64 " (counter-based: no other state)\n",
            mf->seed, mf->data_seed);
    fprintf(out, "loss scale %g (%s)\n", mf->loss_scale,
            mf->loss_scale_mode == MOECKPT__LOSS_SCALE_MODE__DYNAMIC  ? "dynamic"
            : mf->loss_scale_mode == MOECKPT__LOSS_SCALE_MODE__STATIC ? "static"
                                                                      : "none");
    for (size_t i = 0; i < mf->n_placement; i++) {
        fprintf(out, "placement layer %d:", mf->placement[i]->layer);
        for (size_t e = 0; e < mf->placement[i]->n_expert_rank; e++)
            fprintf(out, " %d", mf->placement[i]->expert_rank[e]);
        fputc('\n', out);
    }
    for (size_t i = 0; i < mf->n_files; i++)
        fprintf(out, "file %s %" PRIu64 " bytes (rank %d)\n", mf->files[i]->name,
                mf->files[i]->nbytes, mf->files[i]->writer_rank);
    fprintf(out, "%zu slices:\n", mf->n_tensors);
    size_t biggest = 1;
    for (size_t i = 0; i < mf->n_tensors; i++)
        biggest = mf->tensors[i]->nbytes > biggest ? (size_t)mf->tensors[i]->nbytes : biggest;
    void *buf = malloc(biggest);
    if (!buf) {
        reader_close(&r);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %zu bytes", biggest);
    }
    int bad = 0;
    uint64_t total = 0;
    for (size_t i = 0; i < mf->n_tensors; i++) {
        const Moeckpt__TensorSlice *s = mf->tensors[i];
        char shape[96];
        shape_text(s, shape, sizeof shape);
        moe_status st = read_slice(&r, s, buf);
        fprintf(out,
                "  tensor name=%s layer=%d expert=%d kind=%s shape=%s dtype=%s file=%s "
                "offset=%" PRIu64 " nbytes=%" PRIu64 " crc32c=0x%08" PRIx32 " %s\n",
                s->name, s->layer, s->expert, kind_names[s->kind], shape,
                s->dtype == MOECKPT__DTYPE__F64 ? "f64" : "f32", s->file, s->offset, s->nbytes,
                s->crc32c, st == MOE_OK ? "ok" : "BAD");
        bad += st != MOE_OK;
        total += s->nbytes;
    }
    size_t n_slices = mf->n_tensors;
    free(buf);
    reader_close(&r);
    if (bad)
        MOE_FAIL(MOE_ERR_IO, "%s: %d of %zu slices failed verification (files named above)", path,
                 bad, n_slices);
    fprintf(out, "verified: %zu slices, %" PRIu64 " bytes, every CRC32C matches\n", n_slices,
            total);
    return MOE_OK;
}

/* ---- export to safetensors (Mixtral names) ------------------------------------------ */

typedef struct {
    char name[128];
    const Moeckpt__TensorSlice *slice;
    uint64_t begin, end; /* data offsets in the safetensors byte buffer */
} export_entry;

static int cmp_export(const void *a, const void *b)
{
    return strcmp(((const export_entry *)a)->name, ((const export_entry *)b)->name);
}

/* transformers' Mixtral name of a parameter slice, or 0 if it has none. */
static int mixtral_name(const Moeckpt__TensorSlice *s, char *buf, size_t cap)
{
    static const struct {
        const char *ours, *theirs;
    } layer_map[] = {
        {"attn_norm", "input_layernorm.weight"},
        {"ffn_norm", "post_attention_layernorm.weight"},
        {"attn.wq", "self_attn.q_proj.weight"},
        {"attn.wk", "self_attn.k_proj.weight"},
        {"attn.wv", "self_attn.v_proj.weight"},
        {"attn.wo", "self_attn.o_proj.weight"},
        {"moe.router", "block_sparse_moe.gate.weight"},
    };
    if (strcmp(s->name, "embedding") == 0)
        return snprintf(buf, cap, "model.embed_tokens.weight") > 0;
    if (strcmp(s->name, "final_norm") == 0)
        return snprintf(buf, cap, "model.norm.weight") > 0;
    if (strcmp(s->name, "lm_head") == 0)
        return snprintf(buf, cap, "lm_head.weight") > 0;
    int layer = -1, used = 0;
    if (sscanf(s->name, "layers.%d.%n", &layer, &used) != 1 || used == 0 || layer < 0)
        return 0;
    const char *rest = s->name + used;
    if (s->expert >= 0) {
        if (strcmp(rest, "moe.experts.w1") && strcmp(rest, "moe.experts.w2") &&
            strcmp(rest, "moe.experts.w3"))
            return 0;
        return snprintf(buf, cap, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", layer,
                        s->expert, rest + strlen("moe.experts.")) > 0;
    }
    for (size_t i = 0; i < sizeof layer_map / sizeof layer_map[0]; i++)
        if (strcmp(rest, layer_map[i].ours) == 0)
            return snprintf(buf, cap, "model.layers.%d.%s", layer, layer_map[i].theirs) > 0;
    return 0;
}

static json_t *mixtral_config(const moe_config *c)
{
    json_t *j = json_object();
    if (!j)
        return NULL;
    json_object_set_new(j, "architectures", json_pack("[s]", "MixtralForCausalLM"));
    json_object_set_new(j, "model_type", json_string("mixtral"));
    json_object_set_new(j, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(j, "hidden_size", json_integer(c->d_model));
    json_object_set_new(j, "intermediate_size", json_integer(c->expert_hidden));
    json_object_set_new(j, "num_hidden_layers", json_integer(c->n_layers));
    json_object_set_new(j, "num_attention_heads", json_integer(c->n_heads));
    json_object_set_new(j, "num_key_value_heads", json_integer(c->n_heads));
    json_object_set_new(j, "head_dim", json_integer(c->d_model / c->n_heads));
    json_object_set_new(j, "num_local_experts", json_integer(c->experts));
    json_object_set_new(j, "num_experts_per_tok", json_integer(c->top_k));
    json_object_set_new(j, "rms_norm_eps", json_real(c->norm_eps));
    json_object_set_new(j, "rope_theta", json_real(c->rope_theta));
    json_object_set_new(j, "max_position_embeddings", json_integer(c->seq_len));
    json_object_set_new(j, "hidden_act", json_string("silu"));
    json_object_set_new(j, "initializer_range", json_real(c->init_std));
    json_object_set_new(j, "router_aux_loss_coef", json_real(c->aux_loss_coef));
    json_object_set_new(j, "router_jitter_noise", json_real(0.0));
    json_object_set_new(j, "output_router_logits", json_false());
    json_object_set_new(j, "sliding_window", json_null());
    json_object_set_new(j, "attention_dropout", json_real(0.0));
    json_object_set_new(j, "tie_word_embeddings", json_false());
    json_object_set_new(j, "use_cache", json_true());
    json_object_set_new(j, "torch_dtype", json_string("float32"));
    return j;
}

/* Writes the safetensors file of the sorted entries: header, then each slice's data
 * (verified, converted to float32). */
static moe_status write_safetensors(ckpt_reader *r, export_entry *ent, size_t n, const char *path)
{
    moe_status st = MOE_OK;
    json_t *hdr = json_object();
    char *text = NULL;
    void *raw = NULL;
    float *f32 = NULL;
    int fd = -1;
    if (!hdr)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot build the safetensors header");
    json_object_set_new(hdr, "__metadata__", json_pack("{s:s}", "format", "pt"));
    size_t biggest = 1;
    for (size_t i = 0; i < n; i++) {
        const Moeckpt__TensorSlice *s = ent[i].slice;
        json_t *shape = json_array();
        for (size_t d = 0; d < s->n_shape; d++)
            json_array_append_new(shape, json_integer(s->shape[d]));
        json_object_set_new(hdr, ent[i].name,
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", "F32", "shape", shape,
                                      "data_offsets", (json_int_t)ent[i].begin,
                                      (json_int_t)ent[i].end));
        biggest = s->nbytes > biggest ? (size_t)s->nbytes : biggest;
    }
    text = json_dumps(hdr, JSON_COMPACT | JSON_SORT_KEYS);
    raw = malloc(biggest);
    f32 = malloc(biggest);
    if (!text || !raw || !f32) {
        moe_log_at(__FILE__, __LINE__, "cannot build the safetensors header");
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    size_t hlen = strlen(text), padded = (hlen + 7) & ~(size_t)7;
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        moe_log_at(__FILE__, __LINE__, "cannot create '%s': %s", path, strerror(errno));
        st = MOE_ERR_IO;
        goto fail;
    }
    unsigned char len8[8];
    for (int b = 0; b < 8; b++)
        len8[b] = (unsigned char)((uint64_t)padded >> (8 * b));
    MOE_CHECK_GOTO(st, write_all(fd, len8, 8, path));
    MOE_CHECK_GOTO(st, write_all(fd, text, hlen, path));
    MOE_CHECK_GOTO(st, write_all(fd, "        ", padded - hlen, path));
    for (size_t i = 0; i < n; i++) {
        const Moeckpt__TensorSlice *s = ent[i].slice;
        MOE_CHECK_GOTO(st, read_slice(r, s, raw));
        size_t count = (size_t)(ent[i].end - ent[i].begin) / 4;
        if (s->dtype == MOECKPT__DTYPE__F64)
            for (size_t j = 0; j < count; j++)
                f32[j] = (float)((const double *)raw)[j];
        else
            memcpy(f32, raw, count * 4);
        MOE_CHECK_GOTO(st, write_all(fd, f32, count * 4, path));
    }
fail:
    if (fd >= 0)
        st = sync_close(fd, path, st);
    free(text);
    free(raw);
    free(f32);
    json_decref(hdr);
    return st;
}

moe_status moe_checkpoint_export_safetensors(const char *path, const char *out_dir)
{
    ckpt_reader r;
    moe_config cfg;
    export_entry *ent = NULL;
    json_t *conf = NULL;
    moe_status st = MOE_OK;
    MOE_CHECK(reader_open(&r, path));
    moe_config_defaults(&cfg);
    MOE_CHECK_GOTO(st, moe_config_load_string(&cfg, r.mf->config_ini, "checkpoint config"));
    if (cfg.dense_layers > 0 || cfg.shared_experts > 0 || !cfg.renorm_topk) {
        moe_log("%s: Mixtral cannot express this model: %s", path,
                cfg.dense_layers > 0     ? "[model] dense_layers > 0 (every Mixtral layer is MoE)"
                : cfg.shared_experts > 0 ? "[model] shared_experts > 0 (Mixtral has none)"
                                         : "[model] renorm_topk = false (Mixtral renormalises "
                                           "the top-k weights)");
        st = MOE_ERR_INVALID;
        goto fail;
    }
    size_t n = 0;
    ent = calloc(r.mf->n_tensors ? r.mf->n_tensors : 1, sizeof *ent);
    if (!ent) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate the export table");
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    for (size_t i = 0; i < r.mf->n_tensors; i++) {
        const Moeckpt__TensorSlice *s = r.mf->tensors[i];
        if (s->kind != MOECKPT__TENSOR_KIND__PARAM)
            continue;
        if (!mixtral_name(s, ent[n].name, sizeof ent[n].name)) {
            moe_log("%s: tensor %s has no Mixtral name", path, s->name);
            st = MOE_ERR_INVALID;
            goto fail;
        }
        ent[n++].slice = s;
    }
    if (n > 1)
        qsort(ent, n, sizeof *ent, cmp_export);
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t count =
            ent[i].slice->nbytes / (ent[i].slice->dtype == MOECKPT__DTYPE__F64 ? 8 : 4);
        ent[i].begin = at;
        ent[i].end = at += count * 4;
    }
    MOE_CHECK_GOTO(st, make_dirs(out_dir));
    char file[PATH_CAP], tmp[PATH_CAP + 8];
    snprintf(file, sizeof file, "%s/model.safetensors", out_dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    MOE_CHECK_GOTO(st, write_safetensors(&r, ent, n, tmp));
    if (rename(tmp, file) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot rename '%s': %s", tmp, strerror(errno));
        st = MOE_ERR_IO;
        goto fail;
    }
    conf = mixtral_config(&cfg);
    snprintf(file, sizeof file, "%s/config.json", out_dir);
    if (!conf || json_dump_file(conf, file, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot write '%s'", file);
        st = MOE_ERR_IO;
        goto fail;
    }
    MOE_CHECK_GOTO(st, fsync_dir(out_dir));
fail:
    json_decref(conf);
    free(ent);
    reader_close(&r);
    return st;
}

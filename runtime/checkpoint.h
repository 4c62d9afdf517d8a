/* runtime/checkpoint.h: checkpoints that never lose work: save (collective, atomic),
 * resume (collective, exact, re-sharding experts by global name), inspect and export to
 * safetensors (one process). docs/checkpoints.md describes the format for users.
 *
 * Owns: the checkpoint directory layout, the manifest (proto/checkpoint.proto), the
 * per-rank tensor files, verification (CRC-32C of every slice), choosing the checkpoint
 * to resume from, pruning old ones, the Mixtral export.
 * Does not own: when to save (the trainer), signals and exit statuses (launcher/).
 *
 * Layout of <dir>/step-NNNNNNNN/ (NNNNNNNN: optimizer steps taken, 8 digits):
 *   rank-RRRRR.bin  tensor bytes written by world rank R: rank 0 every dense tensor,
 *                   world rank r < ep the slices of the experts it holds (one slice per
 *                   (tensor, global expert, kind)); kinds param, adam_m, adam_v.
 *   manifest.pb     Manifest (proto/checkpoint.proto): step, config, data position, RNG
 *                   seeds, loss scale, optimizer t, placement, files, every slice.
 *   COMMITTED       text written last by rank 0: "moe-dist checkpoint", the step, and the
 *                   byte count and CRC-32C of manifest.pb (which vouches for the slices).
 * A save writes <dir>/.tmp-step-NNNNNNNN/ (files fsync'ed, a world agreement that every
 * rank's files are on disk, manifest, marker, directory fsync'ed), renames it to
 * step-NNNNNNNN and fsyncs <dir>. A checkpoint counts only with its final name and a
 * valid COMMITTED; .tmp-* directories are never read, and the next save removes them.
 *
 * Errors: a checkpoint that cannot be used (missing, uncommitted, truncated, checksum
 * mismatch) is MOE_ERR_IO with a message naming the file; a config whose model shape
 * differs from the checkpoint's is MOE_ERR_INVALID naming the key. */
#ifndef MOE_RUNTIME_CHECKPOINT_H
#define MOE_RUNTIME_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/config.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "util/fault.h"
#include "util/status.h"

struct moe_comm;

/* The training state besides the tensors. */
typedef struct {
    int64_t step;            /* optimizer steps taken */
    int64_t consumed;        /* global sequences consumed */
    double loss_scale;       /* fp16 dynamic loss scale; 1 without scaling */
    int64_t loss_scale_good; /* clean steps since the scale last changed */
    int loss_scale_dynamic;  /* 1 when fp16 dynamic loss scaling is on */
} moe_ckpt_state;

/* Saves the state of every rank into cfg->ckpt_dir/step-<state->step>/ as described
 * above, then deletes committed checkpoints older than the newest cfg->ckpt_keep (and
 * leftover .tmp-* directories). fault (may be NULL): MOE_FAULT=ckptcrash@R:S ends rank
 * R halfway through writing its file of step S. path (may be NULL, cap bytes) receives
 * the directory written. Collective over the world (comm NULL: one process); every rank
 * returns the same status. */
moe_status moe_checkpoint_save(const moe_config *cfg, struct moe_comm *comm, const moe_model *m,
                               const moe_optimizer *opt, const moe_ckpt_state *state,
                               const moe_fault *fault, char *path, size_t cap);

/* Restores parameters, Adam moments, opt->t and *state from a checkpoint. spec "auto":
 * the newest committed checkpoint in cfg->ckpt_dir whose every checksum (of what this
 * world reads) verifies, falling back to older ones with a warning naming the bad file;
 * no committed checkpoint at all starts fresh (*state zero, *found 0). Otherwise spec is
 * a checkpoint directory, and any defect is an error naming the file. The model shape
 * keys of cfg must equal the checkpoint's (else MOE_ERR_INVALID naming the key); world
 * size and ep may differ (each rank reads the slices of its experts). path (cap bytes)
 * receives the directory used ("" when none). Collective; every rank returns the same
 * status, and on failure the model is unchanged. */
moe_status moe_checkpoint_resume(const char *spec, const moe_config *cfg, struct moe_comm *comm,
                                 moe_model *m, moe_optimizer *opt, moe_ckpt_state *state,
                                 int *found, char *path, size_t cap);

/* Prints the manifest of the checkpoint directory `path` to out (step, config hash,
 * world and ep, placement, files, one line per slice: name, expert, kind, shape, dtype,
 * file, offset, bytes, crc) and verifies every checksum. Returns MOE_ERR_IO naming the
 * first bad file (after printing what it could). One process. */
moe_status moe_checkpoint_inspect(const char *path, FILE *out);

/* Writes out_dir/model.safetensors (F32, transformers' Mixtral tensor names) and
 * out_dir/config.json (MixtralConfig) from the parameters of checkpoint `path`,
 * verifying every slice it reads. Refuses (MOE_ERR_INVALID, with the reason) models
 * Mixtral cannot express: dense_layers > 0, shared_experts > 0, renorm_topk false.
 * Creates out_dir if needed. One process. */
moe_status moe_checkpoint_export_safetensors(const char *path, const char *out_dir);

/* FNV-1a 64 of n bytes (the config hash of the manifest). */
uint64_t moe_fnv1a64(const void *data, size_t n);

#endif

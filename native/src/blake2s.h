/* blake2s.h - the incremental BLAKE2s interface the heartbeat uses (internal, not installed).
 *
 * Why incremental: a datagram's MAC covers a header and a variable list of
 * gossip entries; the key's block is compressed once per monitor (a copy of
 * the keyed state is reused per datagram), which halves the cost per MAC.
 */
#ifndef SX_BLAKE2S_H
#define SX_BLAKE2S_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint32_t t[2];
    uint8_t buf[64];
    size_t buflen;
    size_t outlen;
} blake2s_state;

/* outlen 1..32 bytes, keylen 0..32 bytes; SX_EINVAL otherwise. */
int blake2s_init(blake2s_state *s, size_t outlen, const void *key, size_t keylen);
/* Compresses the key block now, so a copy of the state can MAC many messages; only for messages of at
 * least one byte (an empty message's last block is the key block itself). */
void blake2s_absorb_key(blake2s_state *s);
void blake2s_update(blake2s_state *s, const void *in, size_t len);
/* Writes outlen bytes and wipes the state. */
void blake2s_final(blake2s_state *s, void *out);

#endif

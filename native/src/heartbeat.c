/* heartbeat.c - failure detection over authenticated UDP, decided in a C thread.
 *
 * Why in C: a rank whose Python thread holds the GIL (a long pure-Python
 * loop, a C extension that doesn't release it) must not look dead, and a
 * dead rank must not look alive because some Python thread happened to run.
 * One thread per monitor owns the socket: it probes, answers, authenticates
 * every datagram (keyed BLAKE2s-128, blake2s.c), keeps a replay window per
 * sender and decides suspicion on CLOCK_MONOTONIC. Python only reads
 * snapshots and waits for events (the GIL is released around every call).
 *
 * Liveness is only ever proved by an ACK that echoes one of our own PINGs
 * (its sequence number, send time and target, all under the peer's MAC), so a
 * replayed or redirected datagram can't make a dead peer look alive, even to a
 * receiver that restarted and forgot its replay windows.
 *
 * Two modes (docs/ELASTIC.md, "Failure detection"):
 *  - direct (peers <= direct_limit): every peer is probed every interval; a
 *    peer is suspected once its newest proof of life is older than timeout.
 *  - gossip (more peers): SWIM (Das et al., DSN'02) with Lifeguard's buddy
 *    rule, as HashiCorp memberlist does: one probe per interval in shuffled
 *    round-robin order, indirect probes through k members when the direct ACK
 *    is late, suspicions piggybacked on every datagram and refuted by the
 *    suspect with a higher incarnation, so each node sends O(1) datagrams per
 *    interval whatever the size of the job.
 */
#define _GNU_SOURCE
#include "sneppx.h"
#include "blake2s.h"
#include "status.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define EVENT_RING 4096u
#define RELAY_SLOTS 64
#define RECV_BATCH 64
#define WINDOW_BITS 64
#define NS_PER_S 1000000000LL

/* header field offsets (little-endian; docs/ELASTIC.md has the table) */
enum {
    OFF_MAGIC = 0, OFF_VERSION = 4, OFF_TYPE = 5, OFF_COUNT = 6, OFF_FLAGS = 7, OFF_JOB = 8, OFF_INSTANCE = 24,
    OFF_INCARNATION = 32, OFF_GENERATION = 40, OFF_SEQ = 48, OFF_SEND_TIME = 56, OFF_PROBE_SEQ = 64,
    OFF_PROBE_TIME = 72, OFF_TARGET = 80,
};

typedef struct {
    uint8_t type, count, flags;
    uint64_t instance, incarnation, generation, seq, send_time, probe_seq, probe_time, target;
    const uint8_t *entries;
} datagram;

typedef struct {
    uint64_t id; /* addr << 16 | port: how members name each other on the wire */
    struct sockaddr_in sa;
    sx_hb_peer pub;
    uint64_t top_seq, seen; /* replay window: bit i of seen = top_seq - i was accepted */
    uint64_t window_probe;  /* our seq when the window last started for a new instance of the peer */
    uint64_t retired;       /* the instance the current one replaced: it never comes back */
    int have_seq;
} peer;

typedef struct {
    uint64_t incarnation;
    uint32_t state, transmits;
    int queued;
} update;

typedef struct {
    int used;
    uint32_t origin, target;
    uint64_t origin_seq, origin_time, my_seq;
    int64_t expires;
} relay;

struct sx_hb {
    sx_hb_config cfg;
    int fd, wakefd, mode;
    pthread_t thread;
    int started, stopping, stopped;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    blake2s_state keyed; /* key block already absorbed */
    size_t n;
    peer *peers;
    uint32_t *table; /* open addressing: peer index + 1 by id, 0 = empty */
    size_t table_mask;
    uint64_t self_id, instance, incarnation, seq_start, seq, rng;
    int64_t started_at, next_wake, next_round, last_loop;
    sx_hb_stats stats;
    /* gossip mode */
    uint32_t *order;
    size_t order_pos;
    struct {
        int active, acked, indirect_sent;
        uint32_t target;
        uint64_t seq;
        int64_t sent;
    } probe;
    update *updates; /* one per peer, and [n] for ourselves */
    size_t queued;
    relay relays[RELAY_SLOTS];
    sx_hb_event ring[EVENT_RING];
};

/* ---- small helpers ------------------------------------------------------ */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * NS_PER_S + ts.tv_nsec;
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

static uint64_t member_id(uint32_t addr, uint16_t port) { return (uint64_t)addr << 16 | port; }

static uint64_t next_random(sx_hb *hb) { /* xorshift64*: picks probe order and relays, nothing secret */
    hb->rng ^= hb->rng >> 12;
    hb->rng ^= hb->rng << 25;
    hb->rng ^= hb->rng >> 27;
    return hb->rng * 0x2545F4914F6CDD1DULL;
}

static size_t slot_of(const sx_hb *hb, uint64_t id) { return (size_t)((id * 0x9E3779B97F4A7C15ULL) >> 32) & hb->table_mask; }

static long find_peer(const sx_hb *hb, uint64_t id) {
    for (size_t s = slot_of(hb, id);; s = (s + 1) & hb->table_mask) {
        uint32_t v = hb->table[s];
        if (v == 0) return -1;
        if (hb->peers[v - 1].id == id) return (long)v - 1;
    }
}

static void emit(sx_hb *hb, int kind, uint32_t peer_index, int64_t now) {
    uint64_t index = ++hb->stats.events;
    sx_hb_event *e = &hb->ring[index % EVENT_RING];
    e->index = index;
    e->kind = kind;
    e->peer = peer_index;
    e->time_ns = now;
    e->generation = hb->cfg.generation;
    pthread_cond_broadcast(&hb->cond);
}

static void set_state(sx_hb *hb, uint32_t i, int state, int64_t now) {
    sx_hb_peer *p = &hb->peers[i].pub;
    if (p->state == state) return;
    if (state == SX_HB_SUSPECTED) p->suspicions++;
    p->state = state;
    p->state_since_ns = now;
    emit(hb, state == SX_HB_HEALTHY ? SX_HB_EVENT_HEALTHY
             : state == SX_HB_SUSPECTED ? SX_HB_EVENT_SUSPECTED : SX_HB_EVENT_CONFIRMED, i, now);
}

/* ---- gossip: membership updates piggybacked on datagrams ----------------- */

static void enqueue(sx_hb *hb, size_t index, uint64_t incarnation, uint32_t state) {
    update *u = &hb->updates[index];
    if (!u->queued) hb->queued++;
    u->queued = 1;
    u->incarnation = incarnation;
    u->state = state;
    u->transmits = 0;
}

/* Picks the updates sent least often (newest news first), at most room, fewest transmits first. */
static size_t pick_updates(const sx_hb *hb, size_t *picked, size_t room) {
    size_t count = 0;
    if (!hb->queued || room == 0) return 0;
    for (size_t i = 0; i <= hb->n; i++) {
        if (!hb->updates[i].queued) continue;
        uint32_t t = hb->updates[i].transmits;
        size_t at;
        if (count < room)
            at = count++;
        else if (t < hb->updates[picked[room - 1]].transmits)
            at = room - 1;
        else
            continue;
        while (at > 0 && hb->updates[picked[at - 1]].transmits > t) {
            picked[at] = picked[at - 1];
            at--;
        }
        picked[at] = i;
    }
    return count;
}

static void put_entry(uint8_t *p, uint64_t id, uint64_t incarnation, uint32_t state) {
    put64(p, id);
    put64(p + 8, incarnation);
    put32(p + 16, state);
    put32(p + 20, 0);
}

/* ---- sending -------------------------------------------------------------- */

static void mac(const sx_hb *hb, const uint8_t *buf, size_t len, uint8_t out[SX_HB_MAC_BYTES]) {
    blake2s_state s = hb->keyed;
    blake2s_update(&s, buf, len);
    blake2s_final(&s, out);
}

/* Sends one datagram to peer `to`; returns the sequence number it carried. */
static uint64_t send_to(sx_hb *hb, uint32_t to, int type, int flags, uint64_t probe_seq, uint64_t probe_time,
                        uint64_t target, int64_t now) {
    uint8_t buf[SX_HB_MAX_DATAGRAM];
    uint64_t seq = hb->seq++;
    put32(buf + OFF_MAGIC, SX_HB_MAGIC);
    buf[OFF_VERSION] = SX_HB_VERSION;
    buf[OFF_TYPE] = (uint8_t)type;
    buf[OFF_FLAGS] = (uint8_t)flags;
    memcpy(buf + OFF_JOB, hb->cfg.job_tag, 16);
    put64(buf + OFF_INSTANCE, hb->instance);
    put64(buf + OFF_INCARNATION, hb->incarnation);
    put64(buf + OFF_GENERATION, hb->cfg.generation);
    put64(buf + OFF_SEQ, seq);
    put64(buf + OFF_SEND_TIME, (uint64_t)now);
    put64(buf + OFF_PROBE_SEQ, probe_seq);
    put64(buf + OFF_PROBE_TIME, probe_time);
    put64(buf + OFF_TARGET, target);
    size_t count = 0;
    if (hb->mode == SX_HB_GOSSIP) {
        /* Lifeguard's buddy rule: a member we suspect hears it from us first, so it can refute */
        const sx_hb_peer *dst = &hb->peers[to].pub;
        if (dst->state == SX_HB_SUSPECTED || dst->state == SX_HB_CONFIRMED)
            put_entry(buf + SX_HB_HEADER_BYTES + SX_HB_ENTRY_BYTES * count++, hb->peers[to].id, dst->incarnation,
                      (uint32_t)dst->state);
        size_t picked[SX_HB_MAX_ENTRIES];
        size_t k = pick_updates(hb, picked, SX_HB_MAX_ENTRIES - count);
        for (size_t j = 0; j < k; j++) {
            size_t i = picked[j];
            update *u = &hb->updates[i];
            uint64_t id = i == hb->n ? hb->self_id : hb->peers[i].id;
            put_entry(buf + SX_HB_HEADER_BYTES + SX_HB_ENTRY_BYTES * count++, id, u->incarnation, u->state);
            if (++u->transmits >= hb->cfg.retransmits) {
                u->queued = 0;
                hb->queued--;
            }
        }
    }
    buf[OFF_COUNT] = (uint8_t)count;
    size_t len = SX_HB_HEADER_BYTES + SX_HB_ENTRY_BYTES * count;
    mac(hb, buf, len, buf + len);
    len += SX_HB_MAC_BYTES;
    ssize_t r = sendto(hb->fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL, (const struct sockaddr *)&hb->peers[to].sa,
                       sizeof hb->peers[to].sa);
    if (r == (ssize_t)len)
        hb->stats.sent++;
    else
        hb->stats.send_errors++; /* a full buffer or an unreachable peer is a lost datagram, like any other */
    return seq;
}

static void send_ping(sx_hb *hb, uint32_t to, int64_t now) {
    hb->peers[to].pub.probes_sent++;
    send_to(hb, to, SX_HB_PING, 0, 0, 0, hb->peers[to].id, now);
}

/* ---- proof of life and suspicion ------------------------------------------ */

/* When a peer never heard from may be suspected: members learn of a new membership up to a rendezvous poll
 * apart and start their monitors then, so the first contact gets first_contact_grace on top of the timeout. */
static int64_t first_contact_deadline(const sx_hb *hb) {
    return hb->started_at + (int64_t)hb->cfg.timeout_ns + (int64_t)hb->cfg.first_contact_grace_ns;
}

static void direct_evaluate(sx_hb *hb, uint32_t i, int64_t now) {
    sx_hb_peer *p = &hb->peers[i].pub;
    int alive = p->last_alive_ns >= 0 && now - p->last_alive_ns <= (int64_t)hb->cfg.timeout_ns;
    if (alive)
        set_state(hb, i, SX_HB_HEALTHY, now);
    else if (p->state == SX_HB_HEALTHY || (p->state == SX_HB_UNKNOWN && now > first_contact_deadline(hb)))
        set_state(hb, i, SX_HB_SUSPECTED, now);
}

/* Peer i answered a probe we sent at probe_time: it was alive then. */
static void proof_of_life(sx_hb *hb, uint32_t i, uint64_t probe_time, int64_t now) {
    sx_hb_peer *p = &hb->peers[i].pub;
    int64_t t = (int64_t)probe_time < now ? (int64_t)probe_time : now;
    if (t > p->last_alive_ns) p->last_alive_ns = t;
    if (hb->mode == SX_HB_DIRECT) {
        direct_evaluate(hb, i, now);
    } else {
        if (hb->probe.active && hb->probe.target == i && t >= hb->probe.sent) hb->probe.acked = 1;
        if (p->state == SX_HB_UNKNOWN) { /* first contact; suspicions are only lifted by the member's refutation */
            set_state(hb, i, SX_HB_HEALTHY, now);
            enqueue(hb, i, p->incarnation, SX_HB_HEALTHY);
        }
    }
}

/* Gossip mode: what a membership update (from the wire, or a peer's own header) says about peer i. */
static void apply_update(sx_hb *hb, uint32_t i, uint64_t incarnation, uint32_t state, int64_t now) {
    sx_hb_peer *p = &hb->peers[i].pub;
    int changed = 0;
    if (state == SX_HB_HEALTHY) {
        if (p->state == SX_HB_UNKNOWN || incarnation > p->incarnation) {
            p->incarnation = incarnation;
            set_state(hb, i, SX_HB_HEALTHY, now);
            changed = 1;
        }
    } else if (state == SX_HB_SUSPECTED) {
        if ((p->state == SX_HB_UNKNOWN || p->state == SX_HB_HEALTHY) && incarnation >= p->incarnation) {
            p->incarnation = incarnation;
            set_state(hb, i, SX_HB_SUSPECTED, now);
            changed = 1;
        } else if (p->state == SX_HB_SUSPECTED && incarnation > p->incarnation) {
            p->incarnation = incarnation;
            changed = 1;
        }
    } else if (state == SX_HB_CONFIRMED) {
        if (p->state != SX_HB_CONFIRMED && incarnation >= p->incarnation) {
            p->incarnation = incarnation;
            set_state(hb, i, SX_HB_CONFIRMED, now);
            changed = 1;
        }
    }
    if (changed) enqueue(hb, i, p->incarnation, state);
}

static void apply_entries(sx_hb *hb, const datagram *d, int64_t now) {
    for (size_t k = 0; k < d->count; k++) {
        const uint8_t *e = d->entries + SX_HB_ENTRY_BYTES * k;
        uint64_t id = get64(e), incarnation = get64(e + 8);
        uint32_t state = get32(e + 16);
        if (state < SX_HB_HEALTHY || state > SX_HB_CONFIRMED) continue;
        if (hb->self_id && id == hb->self_id) {
            if (state != SX_HB_HEALTHY && incarnation >= hb->incarnation) { /* refute: we are alive */
                hb->incarnation = incarnation + 1;
                enqueue(hb, hb->n, hb->incarnation, SX_HB_HEALTHY);
            }
            continue;
        }
        long i = find_peer(hb, id);
        if (i >= 0) apply_update(hb, (uint32_t)i, incarnation, state, now);
    }
}

/* ---- receiving ------------------------------------------------------------ */

/* The replay window, per peer, of the process (instance) it was last heard from.
 * - Above the window: news, and the window moves forward. From a new instance, that is the peer's restart
 *   (sequence numbers start at the wall clock, so a restarted process continues above its predecessor).
 * - A new instance below the window (its wall clock stepped back) restarts the window only with an ACK that
 *   echoes a probe we sent after the current window began: that process is alive now. Its predecessor's ACKs,
 *   captured and replayed, echo older probes (it was gone before the window began), so they can't move the
 *   window back, nor count as another restart; an ACK of a new instance needs that proof even above the window.
 * - The instance the current one replaced never comes back: its datagrams are replays, whatever their number. */
static int check_sequence(sx_hb *hb, peer *p, const datagram *d) {
    if (p->have_seq && d->instance != p->pub.instance) {
        int fresh_proof = d->type == SX_HB_ACK && d->probe_seq >= p->window_probe && d->probe_seq < hb->seq;
        if (d->instance == p->retired || (d->type == SX_HB_ACK && !fresh_proof) ||
            (d->seq <= p->top_seq && !fresh_proof))
            return SX_HB_DROP_REPLAY;
        p->retired = p->pub.instance;
        p->seen = 1;
        p->top_seq = d->seq;
        p->window_probe = hb->seq;
        return -1;
    }
    if (!p->have_seq || d->seq > p->top_seq) {
        uint64_t shift = p->have_seq ? d->seq - p->top_seq : WINDOW_BITS;
        p->seen = shift >= WINDOW_BITS ? 1 : p->seen << shift | 1;
        if (!p->have_seq) p->window_probe = hb->seq;
        p->top_seq = d->seq;
        p->have_seq = 1;
        return -1;
    }
    uint64_t behind = p->top_seq - d->seq;
    if (behind >= WINDOW_BITS || (p->seen >> behind & 1)) return SX_HB_DROP_REPLAY;
    p->seen |= 1ULL << behind; /* a second copy of it is a replay */
    return SX_HB_DROP_REORDERED;
}

static int parse(const uint8_t *buf, size_t len, int truncated_by_kernel, datagram *d) {
    if (truncated_by_kernel || len > SX_HB_MAX_DATAGRAM) return SX_HB_DROP_OVERSIZED;
    if (len < 4) return SX_HB_DROP_TRUNCATED;
    if (get32(buf + OFF_MAGIC) != SX_HB_MAGIC) return SX_HB_DROP_BAD_MAGIC;
    if (len < OFF_COUNT + 1) return SX_HB_DROP_TRUNCATED;
    if (buf[OFF_VERSION] != SX_HB_VERSION) return SX_HB_DROP_BAD_VERSION;
    if (buf[OFF_COUNT] > SX_HB_MAX_ENTRIES) return SX_HB_DROP_MALFORMED;
    size_t want = SX_HB_HEADER_BYTES + (size_t)SX_HB_ENTRY_BYTES * buf[OFF_COUNT] + SX_HB_MAC_BYTES;
    if (len < want) return SX_HB_DROP_TRUNCATED;
    if (len > want) return SX_HB_DROP_OVERSIZED;
    d->type = buf[OFF_TYPE];
    d->count = buf[OFF_COUNT];
    d->flags = buf[OFF_FLAGS];
    d->instance = get64(buf + OFF_INSTANCE);
    d->incarnation = get64(buf + OFF_INCARNATION);
    d->generation = get64(buf + OFF_GENERATION);
    d->seq = get64(buf + OFF_SEQ);
    d->send_time = get64(buf + OFF_SEND_TIME);
    d->probe_seq = get64(buf + OFF_PROBE_SEQ);
    d->probe_time = get64(buf + OFF_PROBE_TIME);
    d->target = get64(buf + OFF_TARGET);
    d->entries = buf + SX_HB_HEADER_BYTES;
    return -1;
}

static int own_probe(const sx_hb *hb, uint64_t probe_seq) { return probe_seq >= hb->seq_start && probe_seq < hb->seq; }

/* Whether an authentic datagram asks for something possible: an ACK must answer a probe of ours (for that
 * member, or relayed for a third one), a PING_REQ must name another member. -1 if so, else the drop reason. */
static int check_request(const sx_hb *hb, uint32_t from, const datagram *d) {
    if (d->type == SX_HB_PING && hb->cfg.bind_addr && d->target != hb->self_id)
        return SX_HB_DROP_UNSOLICITED; /* meant for another member (bound to one address, we know our name) */
    if (d->type == SX_HB_PING) return -1;
    long t = find_peer(hb, d->target);
    if (d->type == SX_HB_PING_REQ)
        return hb->mode == SX_HB_GOSSIP && t >= 0 && (uint32_t)t != from ? -1 : SX_HB_DROP_MALFORMED;
    if (!own_probe(hb, d->probe_seq)) return SX_HB_DROP_UNSOLICITED;
    if (d->flags & SX_HB_FLAG_RELAYED)
        return hb->mode == SX_HB_GOSSIP && t >= 0 && (uint32_t)t != from ? -1 : SX_HB_DROP_UNSOLICITED;
    return d->target == hb->peers[from].id ? -1 : SX_HB_DROP_UNSOLICITED;
}

static void on_ack(sx_hb *hb, uint32_t from, const datagram *d, int64_t now) {
    sx_hb_peer *p = &hb->peers[from].pub;
    if (d->flags & SX_HB_FLAG_RELAYED) { /* `from` probed d->target for us */
        proof_of_life(hb, (uint32_t)find_peer(hb, d->target), d->probe_time, now);
        return;
    }
    p->acks_received++;
    uint64_t sample = now > (int64_t)d->probe_time ? (uint64_t)(now - (int64_t)d->probe_time) : 0;
    if (p->rtt_ns == 0) {
        p->rtt_ns = sample;
        p->rtt_var_ns = sample / 2;
    } else { /* RFC 6298's smoothing: 1/8 of the new sample, 1/4 for the variation */
        uint64_t diff = sample > p->rtt_ns ? sample - p->rtt_ns : p->rtt_ns - sample;
        p->rtt_var_ns = (3 * p->rtt_var_ns + diff) / 4;
        p->rtt_ns = (7 * p->rtt_ns + sample) / 8;
    }
    for (int s = 0; s < RELAY_SLOTS; s++) { /* the answer to a probe we made for someone else: pass it on */
        relay *r = &hb->relays[s];
        if (r->used && r->my_seq == d->probe_seq && r->target == from) {
            send_to(hb, r->origin, SX_HB_ACK, SX_HB_FLAG_RELAYED, r->origin_seq, r->origin_time,
                    hb->peers[from].id, now);
            hb->stats.relayed++;
            r->used = 0;
        }
    }
    proof_of_life(hb, from, d->probe_time, now);
}

static void on_ping_req(sx_hb *hb, uint32_t from, const datagram *d, int64_t now) {
    uint32_t t = (uint32_t)find_peer(hb, d->target);
    relay *slot = NULL;
    for (int s = 0; s < RELAY_SLOTS && !slot; s++)
        if (!hb->relays[s].used || hb->relays[s].expires <= now) slot = &hb->relays[s];
    if (!slot) return; /* counted as busy by the caller's check */
    hb->peers[t].pub.probes_sent++;
    *slot = (relay){.used = 1, .origin = from, .target = t, .origin_seq = d->probe_seq,
                    .origin_time = d->probe_time, .expires = now + (int64_t)hb->cfg.interval_ns};
    slot->my_seq = send_to(hb, t, SX_HB_PING, 0, 0, 0, hb->peers[t].id, now);
}

static int relay_slots_full(const sx_hb *hb, int64_t now) {
    for (int s = 0; s < RELAY_SLOTS; s++)
        if (!hb->relays[s].used || hb->relays[s].expires <= now) return 0;
    return 1;
}

static void on_ping(sx_hb *hb, uint32_t from, const datagram *d, int64_t now) {
    hb->peers[from].pub.pings_received++;
    if (!hb->self_id && d->target) { /* bound to every interface: learn the name the others use for us */
        hb->self_id = d->target;
        if (hb->mode == SX_HB_GOSSIP) enqueue(hb, hb->n, hb->incarnation, SX_HB_HEALTHY);
    }
    send_to(hb, from, SX_HB_ACK, 0, d->seq, d->send_time, d->target, now);
}

/* Handles one datagram; returns -1 if it was accepted, else the SX_HB_DROP_* reason. */
static int handle(sx_hb *hb, const uint8_t *buf, size_t len, int truncated, const struct sockaddr_in *src,
                  int64_t now) {
    datagram d;
    hb->stats.received++;
    int reason = parse(buf, len, truncated, &d);
    if (reason >= 0) return reason;
    long i = src->sin_family == AF_INET ? find_peer(hb, member_id(ntohl(src->sin_addr.s_addr), ntohs(src->sin_port)))
                                        : -1;
    if (i < 0) return SX_HB_DROP_UNKNOWN_SENDER;
    uint8_t tag[SX_HB_MAC_BYTES];
    mac(hb, buf, len - SX_HB_MAC_BYTES, tag);
    if (!sx_equal_ct(tag, buf + len - SX_HB_MAC_BYTES, SX_HB_MAC_BYTES)) return SX_HB_DROP_BAD_MAC;
    if (!sx_equal_ct(buf + OFF_JOB, hb->cfg.job_tag, 16)) return SX_HB_DROP_WRONG_JOB;
    if (d.type < SX_HB_PING || d.type > SX_HB_PING_REQ || (d.flags & ~SX_HB_FLAG_RELAYED) ||
        (d.flags && d.type != SX_HB_ACK) || d.instance == 0)
        return SX_HB_DROP_MALFORMED;
    if (d.instance == hb->instance) return SX_HB_DROP_REPLAY; /* our own datagram, reflected back at us */
    if (d.generation < hb->cfg.generation) return SX_HB_DROP_STALE_GENERATION;
    reason = check_request(hb, (uint32_t)i, &d);
    if (reason < 0 && d.type == SX_HB_PING_REQ && relay_slots_full(hb, now)) reason = SX_HB_DROP_BUSY;
    if (reason >= 0) return reason;
    peer *p = &hb->peers[i];
    reason = check_sequence(hb, p, &d);
    if (reason >= 0) return reason;

    hb->stats.accepted++;
    p->pub.accepted++;
    p->pub.last_seen_ns = now;
    if (d.instance != p->pub.instance) {
        if (p->pub.instance) {
            p->pub.restarts++;
            emit(hb, SX_HB_EVENT_RESTARTED, (uint32_t)i, now);
        }
        p->pub.instance = d.instance;
    }
    if (hb->mode == SX_HB_GOSSIP) {
        if (p->pub.state != SX_HB_UNKNOWN) apply_update(hb, (uint32_t)i, d.incarnation, SX_HB_HEALTHY, now);
        apply_entries(hb, &d, now);
    }
    if (d.type == SX_HB_PING) on_ping(hb, (uint32_t)i, &d, now);
    else if (d.type == SX_HB_ACK) on_ack(hb, (uint32_t)i, &d, now);
    else on_ping_req(hb, (uint32_t)i, &d, now);
    return -1;
}

/* ---- timers ----------------------------------------------------------------- */

static void shuffle_order(sx_hb *hb) {
    for (size_t i = hb->n - 1; i > 0; i--) {
        size_t j = next_random(hb) % (i + 1);
        uint32_t t = hb->order[i];
        hb->order[i] = hb->order[j];
        hb->order[j] = t;
    }
    hb->order_pos = 0;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void direct_timers(sx_hb *hb, int64_t now) {
    if (now >= hb->next_round) {
        for (uint32_t i = 0; i < hb->n; i++) send_ping(hb, i, now);
        hb->next_round += (int64_t)hb->cfg.interval_ns;
        if (hb->next_round <= now) hb->next_round = now + (int64_t)hb->cfg.interval_ns; /* we were not scheduled */
    }
    int64_t wake = hb->next_round;
    for (uint32_t i = 0; i < hb->n; i++) {
        direct_evaluate(hb, i, now);
        const sx_hb_peer *p = &hb->peers[i].pub;
        if (p->state == SX_HB_HEALTHY) wake = min64(wake, p->last_alive_ns + (int64_t)hb->cfg.timeout_ns + 1);
        if (p->state == SX_HB_UNKNOWN) wake = min64(wake, first_contact_deadline(hb) + 1);
    }
    hb->next_wake = wake;
}

static void send_indirect_probes(sx_hb *hb, int64_t now) {
    uint32_t target = hb->probe.target, asked = 0;
    for (uint32_t tries = 0; asked < hb->cfg.indirect_probes && tries < 4 * hb->cfg.indirect_probes + 8; tries++) {
        uint32_t r = (uint32_t)(next_random(hb) % hb->n);
        if (r == target || hb->peers[r].pub.state != SX_HB_HEALTHY) continue;
        send_to(hb, r, SX_HB_PING_REQ, 0, hb->probe.seq, (uint64_t)hb->probe.sent, hb->peers[target].id, now);
        asked++;
    }
    hb->probe.indirect_sent = 1;
}

static void gossip_timers(sx_hb *hb, int64_t now) {
    int64_t interval = (int64_t)hb->cfg.interval_ns;
    if (!hb->probe.active || now >= hb->probe.sent + interval) {
        if (hb->probe.active && !hb->probe.acked) {
            uint32_t t = hb->probe.target;
            const sx_hb_peer *p = &hb->peers[t].pub;
            /* no answer, direct or indirect; a member never heard from gets the first-contact grace */
            int judged = p->state == SX_HB_HEALTHY ||
                         (p->state == SX_HB_UNKNOWN &&
                          (hb->cfg.first_contact_grace_ns == 0 || now > first_contact_deadline(hb)));
            if (judged) {
                set_state(hb, t, SX_HB_SUSPECTED, now);
                enqueue(hb, t, p->incarnation, SX_HB_SUSPECTED);
            }
        }
        if (hb->order_pos >= hb->n) shuffle_order(hb);
        uint32_t t = hb->order[hb->order_pos++];
        hb->probe.active = 1;
        hb->probe.acked = 0;
        hb->probe.indirect_sent = 0;
        hb->probe.target = t;
        hb->probe.sent = now;
        hb->peers[t].pub.probes_sent++;
        hb->probe.seq = send_to(hb, t, SX_HB_PING, 0, 0, 0, hb->peers[t].id, now);
    }
    if (!hb->probe.acked && !hb->probe.indirect_sent && now >= hb->probe.sent + (int64_t)hb->cfg.probe_timeout_ns)
        send_indirect_probes(hb, now);
    int64_t wake = hb->probe.sent + interval;
    if (!hb->probe.acked && !hb->probe.indirect_sent)
        wake = min64(wake, hb->probe.sent + (int64_t)hb->cfg.probe_timeout_ns);
    for (uint32_t i = 0; i < hb->n; i++) {
        sx_hb_peer *p = &hb->peers[i].pub;
        if (p->state != SX_HB_SUSPECTED) continue;
        int64_t due = p->state_since_ns + (int64_t)hb->cfg.suspicion_ns;
        if (now >= due) {
            set_state(hb, i, SX_HB_CONFIRMED, now);
            enqueue(hb, i, p->incarnation, SX_HB_CONFIRMED);
        } else {
            wake = min64(wake, due);
        }
    }
    hb->next_wake = wake;
}

/* Our own thread was not scheduled for `lost` ns (the process was stopped, the VM paused, the host
 * overloaded). Peers' silence during that time says nothing about them: move every suspicion clock forward
 * by it, and start a fresh probe instead of judging one whose answer we could not have read. */
static void on_stall(sx_hb *hb, int64_t lost, int64_t now) {
    hb->stats.stalls++;
    hb->started_at += lost;
    for (size_t i = 0; i < hb->n; i++) {
        sx_hb_peer *p = &hb->peers[i].pub;
        if (p->last_alive_ns >= 0) p->last_alive_ns = min64(p->last_alive_ns + lost, now);
        if (p->state == SX_HB_SUSPECTED) p->state_since_ns = min64(p->state_since_ns + lost, now);
    }
    hb->probe.active = 0;
    hb->next_round = hb->next_wake = now;
}

static void *run(void *arg) {
    sx_hb *hb = arg;
    uint8_t bufs[RECV_BATCH][SX_HB_MAX_DATAGRAM + 1];
    struct sockaddr_in addrs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    struct mmsghdr msgs[RECV_BATCH];
    for (;;) {
        pthread_mutex_lock(&hb->lock);
        int64_t now = now_ns();
        if (hb->stopping) {
            pthread_mutex_unlock(&hb->lock);
            break;
        }
        int64_t gap = now - hb->last_loop;
        if (gap > 2 * (int64_t)hb->cfg.interval_ns) on_stall(hb, gap - (int64_t)hb->cfg.interval_ns, now);
        hb->last_loop = now;
        if (now >= hb->next_wake) {
            if (hb->mode == SX_HB_DIRECT) direct_timers(hb, now);
            else gossip_timers(hb, now);
        }
        int64_t wait = hb->next_wake - now;
        pthread_mutex_unlock(&hb->lock);

        struct pollfd fds[2] = {{.fd = hb->fd, .events = POLLIN}, {.fd = hb->wakefd, .events = POLLIN}};
        struct timespec ts = {.tv_sec = wait > 0 ? wait / NS_PER_S : 0, .tv_nsec = wait > 0 ? wait % NS_PER_S : 0};
        if (ppoll(fds, 2, &ts, NULL) <= 0 || !(fds[0].revents & POLLIN)) continue;
        for (int rounds = 0; rounds < 16; rounds++) { /* drain, but let the timers run between batches */
            for (int k = 0; k < RECV_BATCH; k++) {
                iov[k] = (struct iovec){.iov_base = bufs[k], .iov_len = sizeof bufs[k]};
                msgs[k].msg_hdr = (struct msghdr){.msg_name = &addrs[k], .msg_namelen = sizeof addrs[k],
                                                  .msg_iov = &iov[k], .msg_iovlen = 1};
            }
            int got = recvmmsg(hb->fd, msgs, RECV_BATCH, MSG_DONTWAIT, NULL);
            if (got <= 0) break;
            pthread_mutex_lock(&hb->lock);
            now = now_ns();
            for (int k = 0; k < got; k++) {
                int reason = handle(hb, bufs[k], msgs[k].msg_len, (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) != 0,
                                    &addrs[k], now);
                if (reason >= 0) hb->stats.drops[reason]++;
            }
            pthread_mutex_unlock(&hb->lock);
            if (got < RECV_BATCH) break;
        }
    }
    return NULL;
}

/* ---- the public API ------------------------------------------------------------ */

static int net_error(void) {
    sx_record_errno(errno);
    return SX_ENET;
}

/* Dups fd, a bound IPv4 UDP socket, into hb->fd; its address in *sa. */
static int adopt_socket(sx_hb *hb, int fd, struct sockaddr_in *sa) {
    int type = 0, domain = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return net_error();
    len = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) return net_error();
    len = sizeof *sa;
    if (getsockname(fd, (struct sockaddr *)sa, &len) != 0) return net_error();
    if (type != SOCK_DGRAM || domain != AF_INET || sa->sin_family != AF_INET || sa->sin_port == 0)
        return SX_EINVAL; /* not UDP, not IPv4, or not bound */
    hb->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    return hb->fd < 0 ? net_error() : SX_OK;
}

int sx_hb_create(const sx_hb_config *cfg, const uint32_t *addrs, const uint16_t *ports, size_t npeers,
                 sx_hb **out) {
    if (!cfg || !out || (npeers && (!addrs || !ports)) || npeers > (1u << 24) || cfg->interval_ns == 0 ||
        cfg->timeout_ns == 0 || cfg->retransmits == 0)
        return SX_EINVAL;
    for (size_t i = 0; i < npeers; i++)
        if (ports[i] == 0 || (cfg->sock_fd < 0 && addrs[i] == cfg->bind_addr && ports[i] == cfg->bind_port))
            return SX_EINVAL;
    sx_hb *hb = calloc(1, sizeof *hb);
    if (!hb) return SX_ENOMEM;
    hb->cfg = *cfg;
    hb->fd = hb->wakefd = -1;
    hb->n = npeers;
    hb->mode = npeers > cfg->direct_limit ? SX_HB_GOSSIP : SX_HB_DIRECT;
    size_t table = 4;
    while (table < 2 * npeers + 2) table <<= 1;
    hb->table_mask = table - 1;
    hb->peers = calloc(npeers ? npeers : 1, sizeof *hb->peers);
    hb->table = calloc(table, sizeof *hb->table);
    hb->order = calloc(npeers ? npeers : 1, sizeof *hb->order);
    hb->updates = calloc(npeers + 1, sizeof *hb->updates);
    int rc = SX_OK;
    if (!hb->peers || !hb->table || !hb->order || !hb->updates) {
        rc = SX_ENOMEM;
        goto fail;
    }
    for (size_t i = 0; i < npeers; i++) {
        peer *p = &hb->peers[i];
        p->id = member_id(addrs[i], ports[i]);
        if (find_peer(hb, p->id) >= 0) { /* the same member twice */
            rc = SX_EINVAL;
            goto fail;
        }
        p->sa.sin_family = AF_INET;
        p->sa.sin_addr.s_addr = htonl(addrs[i]);
        p->sa.sin_port = htons(ports[i]);
        p->pub.addr = addrs[i];
        p->pub.port = ports[i];
        p->pub.last_seen_ns = p->pub.last_alive_ns = -1;
        p->pub.state_since_ns = now_ns();
        size_t s = slot_of(hb, p->id);
        while (hb->table[s]) s = (s + 1) & hb->table_mask;
        hb->table[s] = (uint32_t)i + 1;
        hb->order[i] = (uint32_t)i;
    }
    if (getrandom(&hb->instance, sizeof hb->instance, 0) != sizeof hb->instance) {
        rc = net_error();
        goto fail;
    }
    hb->instance |= 1; /* never 0: 0 means "not heard" */
    hb->rng = hb->instance;
    struct timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    /* Counting from the wall clock keeps a restarted process ahead of what its peers saw from the last one. */
    hb->seq_start = hb->seq = (uint64_t)real.tv_sec * NS_PER_S + (uint64_t)real.tv_nsec;

    blake2s_init(&hb->keyed, SX_HB_MAC_BYTES, cfg->key, SX_HB_KEY_BYTES);
    blake2s_absorb_key(&hb->keyed);

    hb->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (hb->wakefd < 0) {
        rc = net_error();
        goto fail;
    }
    struct sockaddr_in bind_sa = {.sin_family = AF_INET, .sin_port = htons(cfg->bind_port),
                                  .sin_addr.s_addr = htonl(cfg->bind_addr)};
    socklen_t sl = sizeof bind_sa;
    if (cfg->sock_fd >= 0) {
        /* The caller's socket, held for its whole life: we use a dup (every call passes MSG_DONTWAIT, so its
         * blocking mode, which the dup shares, is left alone) and close only the dup. */
        rc = adopt_socket(hb, cfg->sock_fd, &bind_sa);
        if (rc != SX_OK) goto fail;
        hb->cfg.bind_addr = ntohl(bind_sa.sin_addr.s_addr);
        hb->cfg.bind_port = ntohs(bind_sa.sin_port);
    } else {
        hb->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (hb->fd < 0 || bind(hb->fd, (struct sockaddr *)&bind_sa, sizeof bind_sa) != 0 ||
            getsockname(hb->fd, (struct sockaddr *)&bind_sa, &sl) != 0) {
            rc = net_error();
            goto fail;
        }
    }
    int size = 4 << 20; /* bursts from many peers at once; the kernel caps it at net.core.rmem_max */
    setsockopt(hb->fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    hb->stats.port = ntohs(bind_sa.sin_port);
    for (size_t i = 0; i < npeers; i++)
        if (addrs[i] == hb->cfg.bind_addr && ports[i] == hb->cfg.bind_port) { /* a held socket's own address */
            rc = SX_EINVAL;
            goto fail;
        }
    if (hb->cfg.bind_addr) hb->self_id = member_id(hb->cfg.bind_addr, hb->stats.port);
    if (hb->self_id && find_peer(hb, hb->self_id) >= 0) { /* bound to port 0 and given our own port as a peer */
        rc = SX_EINVAL;
        goto fail;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&hb->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&hb->lock, NULL);
    hb->stats.mode = hb->mode;
    hb->stats.instance = hb->instance;
    *out = hb;
    return SX_OK;
fail:
    if (hb->fd >= 0) close(hb->fd);
    if (hb->wakefd >= 0) close(hb->wakefd);
    free(hb->peers);
    free(hb->table);
    free(hb->order);
    free(hb->updates);
    free(hb);
    return rc;
}

int sx_hb_start(sx_hb *hb) {
    if (!hb) return SX_EINVAL;
    pthread_mutex_lock(&hb->lock);
    int rc = SX_OK;
    if (hb->stopped || hb->stopping) {
        rc = SX_ESTATE;
    } else if (!hb->started) {
        int64_t now = now_ns();
        hb->started_at = hb->next_wake = hb->next_round = hb->last_loop = now;
        for (size_t i = 0; i < hb->n; i++) hb->peers[i].pub.state_since_ns = now;
        if (hb->mode == SX_HB_GOSSIP) {
            shuffle_order(hb);
            if (hb->self_id) enqueue(hb, hb->n, hb->incarnation, SX_HB_HEALTHY);
        }
        int err = pthread_create(&hb->thread, NULL, run, hb);
        if (err) {
            sx_record_errno(err);
            rc = SX_ENOMEM;
        } else {
            hb->started = 1;
        }
    }
    pthread_mutex_unlock(&hb->lock);
    return rc;
}

int sx_hb_stop(sx_hb *hb) {
    if (!hb) return SX_EINVAL;
    pthread_mutex_lock(&hb->lock);
    int join = hb->started && !hb->stopping;
    hb->stopping = 1;
    pthread_mutex_unlock(&hb->lock);
    if (join) {
        uint64_t one = 1;
        ssize_t ignored = write(hb->wakefd, &one, sizeof one);
        (void)ignored;
        pthread_join(hb->thread, NULL);
    }
    pthread_mutex_lock(&hb->lock);
    if (hb->fd >= 0) close(hb->fd); /* the port is free again as soon as the monitor stops (a held one: our dup) */
    hb->fd = -1;
    hb->stopped = 1;
    pthread_cond_broadcast(&hb->cond);
    pthread_mutex_unlock(&hb->lock);
    return SX_OK;
}

void sx_hb_destroy(sx_hb *hb) {
    if (!hb) return;
    sx_hb_stop(hb);
    close(hb->wakefd);
    pthread_mutex_destroy(&hb->lock);
    pthread_cond_destroy(&hb->cond);
    memset(&hb->cfg.key, 0, sizeof hb->cfg.key);
    memset(&hb->keyed, 0, sizeof hb->keyed);
    free(hb->peers);
    free(hb->table);
    free(hb->order);
    free(hb->updates);
    free(hb);
}

int sx_hb_set_generation(sx_hb *hb, uint64_t generation) {
    if (!hb) return SX_EINVAL;
    pthread_mutex_lock(&hb->lock);
    int rc = generation < hb->cfg.generation ? SX_EINVAL : SX_OK;
    if (rc == SX_OK) hb->cfg.generation = generation;
    pthread_mutex_unlock(&hb->lock);
    return rc;
}

int sx_hb_get_stats(sx_hb *hb, sx_hb_stats *out) {
    if (!hb || !out) return SX_EINVAL;
    pthread_mutex_lock(&hb->lock);
    *out = hb->stats;
    out->incarnation = hb->incarnation;
    out->generation = hb->cfg.generation;
    pthread_mutex_unlock(&hb->lock);
    return SX_OK;
}

int sx_hb_get_peers(sx_hb *hb, sx_hb_peer *out, size_t n) {
    if (!hb || (n && !out) || n > hb->n) return SX_EINVAL;
    pthread_mutex_lock(&hb->lock);
    for (size_t i = 0; i < n; i++) out[i] = hb->peers[i].pub;
    pthread_mutex_unlock(&hb->lock);
    return SX_OK;
}

int sx_hb_wait_events(sx_hb *hb, uint64_t after, sx_hb_event *out, size_t max, int64_t timeout_ns, size_t *n) {
    if (!hb || !out || !n || max == 0) return SX_EINVAL;
    *n = 0;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    if (timeout_ns > 0) {
        deadline.tv_sec += timeout_ns / NS_PER_S;
        deadline.tv_nsec += timeout_ns % NS_PER_S;
        if (deadline.tv_nsec >= NS_PER_S) {
            deadline.tv_sec++;
            deadline.tv_nsec -= NS_PER_S;
        }
    }
    pthread_mutex_lock(&hb->lock);
    while (hb->stats.events <= after && !hb->stopped && timeout_ns != 0) {
        int err = timeout_ns < 0 ? pthread_cond_wait(&hb->cond, &hb->lock)
                                 : pthread_cond_timedwait(&hb->cond, &hb->lock, &deadline);
        if (err == ETIMEDOUT) break;
    }
    uint64_t last = hb->stats.events;
    uint64_t first = after + 1;
    if (last >= EVENT_RING && first < last - EVENT_RING + 1) first = last - EVENT_RING + 1;
    for (uint64_t k = first; k <= last && *n < max; k++) out[(*n)++] = hb->ring[k % EVENT_RING];
    int rc = *n ? SX_OK : hb->stopped ? SX_ESTATE : SX_ETIMEDOUT;
    pthread_mutex_unlock(&hb->lock);
    return rc;
}

const char *sx_hb_drop_name(int reason) {
    static const char *const names[SX_HB_NDROPS] = {
        "truncated", "oversized", "bad_magic", "bad_version", "bad_mac", "wrong_job", "unknown_sender",
        "stale_generation", "replay", "reordered", "unsolicited", "malformed", "busy"};
    return reason >= 0 && reason < SX_HB_NDROPS ? names[reason] : "unknown";
}

/* elastic.c - the lifecycle of one node of an elastic job, as a pure state machine.
 *
 * Why a table in C: every component that reacts to membership (heartbeats,
 * rendezvous, the trainer, the operator's view of a rank) must agree on what
 * may follow what. One table, no I/O, no clock, so it can be checked
 * exhaustively against a model (tests/unit/elastic/test_elastic_lifecycle.py) and
 * shared by anything that links the core. Illegal events change nothing and
 * return SX_ESTATE: a late timer or a duplicate "reconfigured" is a bug to
 * see, not a state to drift into. The node agent (runtime/SneppX_ALG/elastic/agent.py)
 * drives one per node, through elastic/lifecycle.py.
 */
#include "sneppx.h"

#define X (-1) /* illegal */

/* NEXT[state][event]; events: join, leave, peer_failed, timeout, reconfigured, budget_exhausted, fatal */
static const int NEXT[SX_EL_NSTATES][SX_EL_NEVENTS] = {
    /* INIT: not yet part of any membership. From any live state, `leave` ends cleanly and `budget_exhausted` or
     * `fatal` (an error no restart fixes: a rollback limit, a worker's fatal error, the OOM killer) ends in failure */
    [SX_EL_INIT] = {SX_EL_JOINING, SX_EL_STOPPED, X, X, X, SX_EL_FAILED, SX_EL_FAILED},
    /* JOINING: waiting in a rendezvous; peers dropping out is part of forming, a timeout ends it */
    [SX_EL_JOINING] = {X, SX_EL_STOPPED, SX_EL_JOINING, SX_EL_FAILED, SX_EL_RUNNING, SX_EL_FAILED, SX_EL_FAILED},
    /* RUNNING: training in generation g; a lost peer or a node asking to join re-forms the membership */
    [SX_EL_RUNNING] = {SX_EL_RECONFIGURING, SX_EL_STOPPED, SX_EL_RECONFIGURING, X, X, SX_EL_FAILED, SX_EL_FAILED},
    /* RECONFIGURING: forming generation g+1 with the survivors; too few before the deadline fails */
    [SX_EL_RECONFIGURING] = {SX_EL_RECONFIGURING, SX_EL_STOPPED, SX_EL_RECONFIGURING, SX_EL_FAILED, SX_EL_RUNNING,
                             SX_EL_FAILED, SX_EL_FAILED},
    /* STOPPED and FAILED are final: a node that comes back starts a new machine (and joins a new generation) */
    [SX_EL_STOPPED] = {X, X, X, X, X, X, X},
    [SX_EL_FAILED] = {X, X, X, X, X, X, X},
};

static const char *const STATE_NAMES[SX_EL_NSTATES] = {"init", "joining", "running", "reconfiguring", "stopped",
                                                       "failed"};
static const char *const EVENT_NAMES[SX_EL_NEVENTS] = {"join", "leave", "peer_failed", "timeout", "reconfigured",
                                                       "budget_exhausted", "fatal"};

void sx_elastic_init(sx_elastic *m) {
    m->state = SX_EL_INIT;
    m->generation = 0;
    m->transitions = 0;
}

int sx_elastic_next(int state, int event) {
    if (state < 0 || state >= SX_EL_NSTATES || event < 0 || event >= SX_EL_NEVENTS) return SX_EINVAL;
    int next = NEXT[state][event];
    return next == X ? SX_ESTATE : next;
}

int sx_elastic_fire(sx_elastic *m, int event, uint64_t generation) {
    if (!m) return SX_EINVAL;
    int next = sx_elastic_next(m->state, event);
    if (next < 0) return next;
    if (event == SX_EL_RECONFIGURED) {
        if (generation == 0) generation = m->generation + 1;
        if (generation <= m->generation) return SX_EINVAL; /* generations only move forward */
        m->generation = generation;
    }
    m->state = next;
    m->transitions++;
    return SX_OK;
}

const char *sx_elastic_state_name(int state) {
    return state >= 0 && state < SX_EL_NSTATES ? STATE_NAMES[state] : "unknown";
}

const char *sx_elastic_event_name(int event) {
    return event >= 0 && event < SX_EL_NEVENTS ? EVENT_NAMES[event] : "unknown";
}

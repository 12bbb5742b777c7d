/* libFuzzer target: one heartbeat datagram into the failure detector (native/src/heartbeat.c), as if it had
 * arrived from a member, under ASan and UBSan. The file is included whole to reach its static receive path
 * (handle: parse, MAC, job, type, sequence window, membership updates, replies).
 *
 * The first input byte chooses: bit 0 set, the MAC is recomputed over the mutated bytes with the monitor's key
 * (the fuzzer explores what lies behind it); clear, the bytes go in as they are (the check itself is fuzzed).
 * Bit 1 picks the monitor: direct mode (2 members) or gossip mode (its membership updates). Replies go to
 * 127.0.0.1 ports nobody listens on. */
#include "../../../native/src/heartbeat.c"

static sx_hb *monitors[2];

static sx_hb *monitor(int gossip) {
    if (!monitors[gossip]) {
        sx_hb_config cfg = {0};
        cfg.bind_addr = INADDR_LOOPBACK; /* host order, as the config takes addresses */
        cfg.interval_ns = 100000000;
        cfg.timeout_ns = 1000000000;
        cfg.probe_timeout_ns = 200000000;
        cfg.suspicion_ns = 1000000000;
        cfg.direct_limit = gossip ? 0 : 64;
        cfg.indirect_probes = 2;
        cfg.retransmits = 3;
        cfg.sock_fd = -1;
        for (int i = 0; i < 32; i++) cfg.key[i] = (uint8_t)i;
        for (int i = 0; i < 16; i++) cfg.job_tag[i] = (uint8_t)(0xA0 + i);
        uint32_t addrs[3] = {INADDR_LOOPBACK, INADDR_LOOPBACK, INADDR_LOOPBACK};
        uint16_t ports[3] = {9, 13, 17};
        if (sx_hb_create(&cfg, addrs, ports, gossip ? 3 : 2, &monitors[gossip]) != SX_OK) abort();
    }
    return monitors[gossip];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > SX_HB_MAX_DATAGRAM + 1) return 0;
    sx_hb *hb = monitor(data[0] >> 1 & 1);
    uint8_t buf[SX_HB_MAX_DATAGRAM];
    size_t len = size - 1;
    memcpy(buf, data + 1, len);
    if ((data[0] & 1) && len >= SX_HB_MAC_BYTES) mac(hb, buf, len - SX_HB_MAC_BYTES, buf + len - SX_HB_MAC_BYTES);
    struct sockaddr_in from = {.sin_family = AF_INET, .sin_port = htons(13), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    handle(hb, buf, len, 0, &from, now_ns());
    return 0;
}

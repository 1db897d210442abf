/* feed_common.c - what the feed's server and client share: deadlines, the
 * statuses a peer may send, this host's identity and the environment's
 * shared-memory settings (feed_internal.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "ember/error.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "feed_internal.h"
/* Absolute deadline; a negative timeout means "no limit". */
int64_t ember__feed_deadline(int64_t timeout_ms) {
  return timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
}

/* 1 if code is one of the EMBER_E* values (for statuses read off the wire). */
int ember__feed_known_status(int32_t code) {
#define FEED__KNOWN(name, value, desc) if (code == (value)) return 1;
  EMBER_ERRNO_MAP(FEED__KNOWN)
#undef FEED__KNOWN
  return 0;
}

/* This host's identity for FEED_SHM: the kernel's boot id, mixed with the
 * network namespace's inode, 16 bytes; all zero when unknown.  Containers on
 * one kernel share the boot id; those with a network of their own are other
 * hosts to Spark (their own address), and their /dev/shm and /proc may be
 * too, so only a producer in this network namespace is offered the ring. */
void ember__feed_host_id(uint8_t out[16]) {
  char buf[64];
  size_t n = 0;
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  memset(out, 0, 16);
  if (f == NULL) return;
  if (fgets(buf, sizeof buf, f) != NULL) {
    for (const char *p = buf; *p && n < 32; p++) {
      int v = (*p >= '0' && *p <= '9') ? *p - '0'
              : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
              : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10
                                         : -1;
      if (v < 0) continue;
      out[n / 2] = (uint8_t)(out[n / 2] | (n % 2 ? v : v << 4));
      n++;
    }
  }
  fclose(f);
  if (n != 32) {
    memset(out, 0, 16);
    return;
  }
  struct stat netns;
  if (stat("/proc/self/ns/net", &netns) == 0) {
    uint64_t ino = (uint64_t)netns.st_ino;
    for (int i = 0; i < 8; i++) out[8 + i] ^= (uint8_t)(ino >> (8 * i));
  }
}

/* EMBER_FEED_SHM=0 (or "false", "no", "off") turns shared memory off. */
int ember__feed_env_shm_enabled(void) {
  const char *v = getenv("EMBER_FEED_SHM");
  if (v == NULL) return 1;
  return !(strcmp(v, "0") == 0 || strcasecmp(v, "false") == 0 || strcasecmp(v, "no") == 0 ||
           strcasecmp(v, "off") == 0);
}

size_t ember__feed_env_ring_bytes(void) {
  const char *v = getenv("EMBER_FEED_SHM_BYTES");
  char *end = NULL;
  unsigned long long n;
  if (v == NULL || *v == '\0') return FEED_DEFAULT_RING;
  n = strtoull(v, &end, 10);
  if (*end != '\0' || n < EMBER_SHM_RING_MIN_BYTES || n > EMBER_SHM_RING_MAX_BYTES)
    return FEED_DEFAULT_RING;
  return (size_t)n;
}
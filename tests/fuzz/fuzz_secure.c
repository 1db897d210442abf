/* fuzz_secure.c - libFuzzer harness for the encrypted record layer's parser
 * (secure.h), the one parser of bytes a man in the middle controls once a
 * connection encrypts.
 *
 * The first input byte picks how the rest is used:
 *   even: the rest is the raw stream a hostile peer sends (record headers,
 *         lengths, ciphertext, tags: anything);
 *   odd:  the rest is plaintext that a genuine sender seals into records of
 *         input-derived sizes, which a man in the middle then alters (flip a
 *         bit, drop, duplicate or swap a record, cut the stream) at an
 *         input-derived place.
 * The receiver reads with input-derived sizes (peek included).  Besides "no
 * crash, no out-of-bounds access, no leak" (ASan/UBSan), it checks that
 * whatever is delivered is exactly a prefix of what the genuine sender sent
 * (nothing altered is ever delivered), that an unaltered stream is delivered
 * whole, and that an altered one ends in EMBER_ETAMPERED (or EMBER_ECLOSED
 * when a whole record was cut off at the end). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ember/error.h"
#include "ember/secure.h"

static const uint8_t SECRET[32] = "fuzz-secret-fuzz-secret-fuzz-sec";
static const uint8_t SN[32] = {1};
static const uint8_t CN[32] = {2};

#define require(cond)                                                  \
  do {                                                                 \
    if (!(cond)) {                                                     \
      fprintf(stderr, "fuzz_secure.c:%d: %s failed\n", __LINE__, #cond); \
      abort();                                                         \
    }                                                                  \
  } while (0)

static uint32_t next_rand(uint32_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 17;
  *s ^= *s << 5;
  return *s;
}

/* Writes wire[] into fd while receiving through rx; returns the status that
 * ended the reading (EMBER_OK when every expected byte came). */
static int pump(ember_sec *rx, int wfd, int rfd, const uint8_t *wire, size_t wlen,
                uint8_t *got, size_t cap, size_t *ngot, uint32_t *seed) {
  size_t woff = 0;
  int shut = 0, idle = 0;
  *ngot = 0;
  for (;;) {
    if (woff < wlen) {
      ssize_t w = send(wfd, wire + woff, wlen - woff, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w > 0) woff += (size_t)w;
    } else if (!shut) {
      shutdown(wfd, SHUT_WR);
      shut = 1;
    }
    size_t want = 1 + next_rand(seed) % 70000;
    if (want > cap - *ngot) want = cap - *ngot;
    if (want == 0) want = 1; /* more than expected: reading on must fail or end */
    uint8_t tmp[16];
    long n;
    if ((next_rand(seed) & 7) == 0) {
      n = ember_sec_peek(rx, rfd, tmp, sizeof tmp);
      if (n > 0) continue;
    } else if (*ngot < cap) {
      n = ember_sec_recv(rx, rfd, got + *ngot, want);
    } else {
      n = ember_sec_recv(rx, rfd, tmp, sizeof tmp);
      require(n <= 0); /* nothing beyond what the sender sent */
    }
    if (n > 0) {
      *ngot += (size_t)n;
      idle = 0;
      continue;
    }
    if (n < 0) return (int)n;
    if (shut && ++idle > 4) return EMBER_EAGAIN; /* cannot happen: EOF ends it */
  }
}

static int on_boundary(const size_t *starts, size_t n, size_t at) {
  for (size_t i = 0; i < n; i++)
    if (starts[i] == at) return 1;
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > (1u << 16)) return 0;
  int sv[2];
  ember_sec *tx = NULL, *rx = NULL;
  uint32_t seed = 0x9e3779b9u ^ (uint32_t)size;
  for (size_t i = 0; i < size && i < 16; i++) seed = seed * 31u + data[i];
  if (seed == 0) seed = 1;
  require(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) == 0);
  require(ember_sec_create(&tx, SECRET, 32, SN, CN, EMBER_SEC_CLIENT, "fuzz-tx") == EMBER_OK);
  require(ember_sec_create(&rx, SECRET, 32, SN, CN, EMBER_SEC_SERVER, "fuzz-rx") == EMBER_OK);
  const uint8_t *rest = data + 1;
  size_t nrest = size - 1;
  uint8_t *got = malloc(nrest + 1);
  size_t ngot = 0;

  if ((data[0] & 1) == 0) {
    int rc = pump(rx, sv[0], sv[1], rest, nrest, got, nrest + 1, &ngot, &seed);
    /* a forged stream can never be read as records (no key) */
    require(ngot == 0);
    require(rc == EMBER_ETAMPERED || rc == EMBER_ECLOSED);
  } else {
    /* seal the plaintext into records, through a second socketpair */
    int tp[2];
    require(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, tp) == 0);
    int bufsz = 1 << 20;
    setsockopt(tp[0], SOL_SOCKET, SO_SNDBUF, &bufsz, sizeof bufsz);
    setsockopt(tp[1], SOL_SOCKET, SO_RCVBUF, &bufsz, sizeof bufsz);
    size_t off = 0, nrec = 0;
    size_t starts[512];
    uint8_t *wire = malloc(nrest + 512 * EMBER_SEC_OVERHEAD + 64);
    size_t wlen = 0;
    while (off < nrest && nrec < 512) {
      size_t k = 1 + next_rand(&seed) % 3000;
      if (k > nrest - off) k = nrest - off;
      struct iovec iov = {.iov_base = (void *)(uintptr_t)(rest + off), .iov_len = k};
      long n = ember_sec_send(tx, tp[0], &iov, 1);
      require(n == (long)k);
      starts[nrec++] = wlen;
      ssize_t r = recv(tp[1], wire + wlen, k + EMBER_SEC_OVERHEAD, MSG_DONTWAIT);
      require(r == (ssize_t)(k + EMBER_SEC_OVERHEAD));
      wlen += (size_t)r;
      off += k;
    }
    close(tp[0]);
    close(tp[1]);
    size_t sent = off;
    int mutate = nrec > 0 ? (int)(next_rand(&seed) % 6) : 0;
    size_t at = nrec > 0 ? next_rand(&seed) % nrec : 0;
    size_t rec_end = at + 1 < nrec ? starts[at + 1] : wlen;
    uint8_t *alt = malloc(wlen * 2 + 1);
    size_t alen = 0;
    switch (mutate) {
      case 1: /* flip one bit anywhere in record `at` */
        memcpy(alt, wire, wlen);
        alen = wlen;
        alt[starts[at] + next_rand(&seed) % (rec_end - starts[at])] ^=
            (uint8_t)(1u << (next_rand(&seed) % 8));
        break;
      case 2: /* drop record `at` */
        memcpy(alt, wire, starts[at]);
        memcpy(alt + starts[at], wire + rec_end, wlen - rec_end);
        alen = wlen - (rec_end - starts[at]);
        break;
      case 3: /* replay record `at` */
        memcpy(alt, wire, rec_end);
        memcpy(alt + rec_end, wire + starts[at], wlen - starts[at]);
        alen = wlen + (rec_end - starts[at]);
        break;
      case 4: /* cut the stream anywhere after record `at` starts */
        alen = starts[at] + next_rand(&seed) % (wlen - starts[at]);
        memcpy(alt, wire, alen);
        break;
      default: /* unaltered */
        memcpy(alt, wire, wlen);
        alen = wlen;
        mutate = 0;
        break;
    }
    int rc = pump(rx, sv[0], sv[1], alt, alen, got, nrest + 1, &ngot, &seed);
    require(ngot <= sent && memcmp(got, rest, ngot) == 0); /* only genuine bytes */
    if (mutate == 0) {
      require(ngot == sent);
      require(rc == EMBER_ECLOSED);
    } else if ((mutate == 2 && at + 1 == nrec) || (mutate == 4 && on_boundary(starts, nrec, alen))) {
      /* cut between records (the last one dropped): a clean end of the
       * stream here; the protocols above never take an end for complete
       * data (the feed's END_PARTITION/ACK, the collectives' byte counts) */
      require(rc == EMBER_ECLOSED);
    } else {
      require(rc == EMBER_ETAMPERED);
    }
    free(alt);
    free(wire);
  }
  free(got);
  ember_sec_destroy(tx);
  ember_sec_destroy(rx);
  close(sv[0]);
  close(sv[1]);
  return 0;
}

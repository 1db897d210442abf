/* feed_client.c - the feed client: blocking calls with deadlines over net.h
 * (protocol: ember/feed.h; contract details at the top of feed_server.c).
 * A client handle is for one thread at a time: send() also reads the socket
 * (client_check_refused) and the handle's flags are unlocked.
 */
#include "ember/feed.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "feed_internal.h"

/* RESULTS frames the client accepts; results are trainer output, usually far
 * smaller than input, but bounded all the same. */
#define FEED_CLIENT_MAX_FRAME FEED_DEFAULT_MAX_FRAME
/* iovecs per writev: stays under IOV_MAX (1024). */
#define FEED_IOV_CHUNK 512

typedef struct pending_result {
  struct pending_result *next;
  uint8_t *data;
  size_t len;
} pending_result;

struct ember_feed_client {
  int fd;
  ember_sec *sec; /* the record layer when encrypting; NULL in clear */
  uint32_t partition, flags;
  uint64_t rows_sent;
  uint64_t resume_records; /* FEED_RESUME: records the node already holds */
  int resume_delivered;    /* FEED_RESUME: the partition was delivered whole */
  int broken; /* a send failed half-way or the server refused us */
  int ended;  /* END_PARTITION or END_FEED acknowledged */
  int end_sent; /* END_PARTITION sent, its ACK not yet read (end_partition_send) */
  char peer[64];
  /* RESULTS that arrived while end_partition waited for the ACK; handed out
   * by recv_results first, in order. */
  pending_result *res_head, *res_tail;
  uint8_t *scratch; /* frame header + batch descriptors */
  size_t scratch_cap;
  struct iovec *iov;
  size_t iov_cap;
  /* shared memory: offered by the first send when shm_wanted */
  int shm_wanted;
  int shm_decided;
  size_t shm_bytes;
  ember_shm_ring *ring; /* non-NULL: batches go through it */
  /* a batch between begin_batch and commit_batch */
  int pending;           /* PENDING_* */
  uint8_t *pending_buf;  /* its first byte: ring memory or scratch + BATCH_IN_SCRATCH */
  size_t pending_total;
  uint32_t pending_ncols, pending_nrows;
  ember_column *pending_cols; /* the caller's, data and offsets set to their places */
  size_t pending_cols_cap;
};

enum { PENDING_NONE, PENDING_RING, PENDING_SCRATCH };
/* A batch built in the scratch buffer starts 16-aligned, its frame header
 * just before it. */
#define BATCH_IN_SCRATCH 16u

void ember_feed_client_destroy(ember_feed_client *c) {
  pending_result *p, *nx;
  if (c == NULL) return;
  free(c->pending_cols);
  /* The ring first: a server still reading it sees the producer close
   * (after any END already written), then the socket close. */
  ember_shm_ring_destroy(c->ring);
  ember_net_close(c->fd);
  ember_sec_destroy(c->sec);
  for (p = c->res_head; p; p = nx) {
    nx = p->next;
    free(p->data);
    free(p);
  }
  free(c->scratch);
  free(c->iov);
  free(c);
}

int ember_feed_client_connect(ember_feed_client **out, const char *host, uint16_t port,
                              const uint8_t *secret, size_t secret_len, uint32_t partition,
                              uint32_t flags, int64_t timeout_ms) {
  return ember_feed_client_connect_ex(out, host, port, secret, secret_len, partition, flags,
                                      NULL, timeout_ms);
}

static int client_read_resume(ember_feed_client *c, int64_t deadline);

int ember_feed_client_connect_ex(ember_feed_client **out, const char *host, uint16_t port,
                                 const uint8_t *secret, size_t secret_len, uint32_t partition,
                                 uint32_t flags, const ember_feed_client_options *opts,
                                 int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  ember_feed_client *c = NULL;
  uint8_t hello[24 + EMBER_FEED_TAG_MAX];
  size_t tag_len = opts ? opts->tag_len : 0;
  int rc = EMBER_OK;
  if (out == NULL || host == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: NULL argument");
    goto cleanup;
  }
  *out = NULL;
  if (flags & ~(EMBER_FEED_WANT_RESULTS | EMBER_FEED_RESUME)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: unknown flags 0x%x", flags);
    goto cleanup;
  }
  if (opts != NULL && (opts->shm < EMBER_FEED_SHM_AUTO || opts->shm > EMBER_FEED_SHM_ON)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: unknown shm mode %d", opts->shm);
    goto cleanup;
  }
  if (opts != NULL && opts->shm_bytes != 0 &&
      (opts->shm_bytes < EMBER_SHM_RING_MIN_BYTES || opts->shm_bytes > EMBER_SHM_RING_MAX_BYTES)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: shm_bytes %zu is outside %u..%u",
                          opts->shm_bytes, EMBER_SHM_RING_MIN_BYTES, EMBER_SHM_RING_MAX_BYTES);
    goto cleanup;
  }
  if (tag_len > EMBER_FEED_TAG_MAX || (tag_len > 0 && opts->tag == NULL)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: a tag of %zu bytes (at most %u)",
                          tag_len, EMBER_FEED_TAG_MAX);
    goto cleanup;
  }
  c = calloc(1, sizeof *c);
  if (c == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "feed connect: out of memory");
    goto cleanup;
  }
  c->fd = -1;
  c->partition = partition;
  c->flags = flags;
  {
    int mode = opts ? opts->shm : EMBER_FEED_SHM_AUTO;
    c->shm_wanted = mode == EMBER_FEED_SHM_ON || (mode == EMBER_FEED_SHM_AUTO && ember__feed_env_shm_enabled());
    c->shm_bytes = opts && opts->shm_bytes ? opts->shm_bytes : ember__feed_env_ring_bytes();
  }
  rc = ember__connect_auth_ex(host, port, secret, secret_len,
                              opts && opts->encrypt ? EMBER_AUTH_ENCRYPT : 0, deadline, &c->fd,
                              &c->sec);
  if (rc != EMBER_OK) goto cleanup;
  (void)ember_net_tune(c->fd);
  ember_net_peer_name(c->fd, c->peer, sizeof c->peer);
  ember_wire_put_u32(hello, partition);
  ember_wire_put_u32(hello + 4, flags);
  ember_wire_put_u64(hello + 8, opts ? opts->call : 0);
  ember_wire_put_u32(hello + 16, opts ? opts->call_partitions : 0);
  ember_wire_put_u32(hello + 20, (uint32_t)tag_len);
  if (tag_len > 0) memcpy(hello + 24, opts->tag, tag_len);
  rc = ember_sec_send_frame(c->sec, c->fd, EMBER_MSG_FEED_HELLO, hello, (uint32_t)(24 + tag_len),
                            deadline);
  if (rc != EMBER_OK) goto cleanup;
  if (flags & EMBER_FEED_RESUME) {
    rc = client_read_resume(c, deadline);
    if (rc != EMBER_OK) goto cleanup;
  }
  *out = c;
  c = NULL;
cleanup:
  ember_feed_client_destroy(c);
  return rc;
}

/* Turns an ACK/REFUSED payload (u32 status, str reason) into a status code
 * and the thread's error message. */
static int client_status(ember_feed_client *c, uint16_t type, const uint8_t *p, uint32_t len) {
  ember_wire_reader r;
  char reason[FEED_REASON_MAX + 1];
  int32_t st;
  ember_wire_reader_init(&r, p, len);
  st = (int32_t)ember_wire_read_u32(&r);
  ember_wire_read_str(&r, reason, sizeof reason);
  if (ember_wire_reader_finish(&r, 1, ember_wire_type_name(type)) != EMBER_OK) {
    c->broken = 1;
    return EMBER_EPROTO; /* reader set the message */
  }
  if (type == EMBER_MSG_REFUSED) c->broken = 1;
  if (st == EMBER_OK && type == EMBER_MSG_ACK) return EMBER_OK;
  if (st >= 0 || !ember__feed_known_status(st)) st = EMBER_EPROTO;
  return ember__set_error(st, "feed server %s (partition %u) %s: %s", c->peer, c->partition,
                          type == EMBER_MSG_REFUSED ? "refused the producer" : "answered",
                          reason[0] ? reason : ember_strerror(st));
}

static int client_usable(ember_feed_client *c, const char *what) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "feed %s: NULL client", what);
  if (c->broken)
    return ember__set_error(EMBER_ESTATE,
                            "feed %s: the connection to %s is unusable after an earlier error",
                            what, c->peer);
  return EMBER_OK;
}

/* Receives the next frame; RESULTS are returned to the caller as-is. */
static int client_recv(ember_feed_client *c, ember_frame_header *fh, uint8_t **payload,
                       int64_t deadline, const char *what) {
  int rc = ember_sec_recv_frame(c->sec, c->fd, FEED_CLIENT_MAX_FRAME, fh, payload, deadline);
  if (rc != EMBER_OK && rc != EMBER_ETIMEDOUT) c->broken = 1;
  if (rc == EMBER_ECLOSED)
    rc = ember__set_error(EMBER_ECLOSED, "feed %s: node %s closed the connection (partition %u)",
                          what, c->peer, c->partition);
  return rc;
}

/* The answer to a resuming FEED_HELLO: FEED_RESUME, or REFUSED. */
static int client_read_resume(ember_feed_client *c, int64_t deadline) {
  ember_frame_header fh;
  uint8_t *payload = NULL;
  int rc = client_recv(c, &fh, &payload, deadline, "connect");
  if (rc != EMBER_OK) goto done;
  if (fh.type == EMBER_MSG_REFUSED) {
    rc = client_status(c, fh.type, payload, fh.length);
  } else if (fh.type != EMBER_MSG_FEED_RESUME || fh.length != 12) {
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed connect: node %s answered a resuming FEED_HELLO "
                          "with %s (%u bytes), expected FEED_RESUME (12 bytes)", c->peer,
                          ember_wire_type_name(fh.type), fh.length);
  } else {
    c->resume_delivered = ember_wire_get_u32(payload) != 0;
    c->resume_records = ember_wire_get_u64(payload + 4);
  }
done:
  free(payload);
  return rc;
}

void ember_feed_client_resume_point(const ember_feed_client *c, uint64_t *records,
                                    int *delivered) {
  if (records) *records = c ? c->resume_records : 0;
  if (delivered) *delivered = c ? c->resume_delivered : 0;
}

/* Keeps a RESULTS payload that arrived while we waited for something else,
 * for recv_results (takes payload over). */
static int client_keep_result(ember_feed_client *c, uint8_t *payload, size_t len,
                              const char *what) {
  pending_result *pr = calloc(1, sizeof *pr);
  if (pr != NULL) pr->data = payload ? payload : malloc(1);
  if (pr == NULL || pr->data == NULL) {
    free(payload);
    free(pr);
    c->broken = 1;
    return ember__set_error(EMBER_ENOMEM, "feed %s: out of memory", what);
  }
  pr->len = len;
  if (c->res_tail) c->res_tail->next = pr;
  else c->res_head = pr;
  c->res_tail = pr;
  return EMBER_OK;
}

/* Milliseconds left until deadline, for calls that take a timeout. */
static int64_t ms_left(int64_t deadline) {
  int64_t left;
  if (deadline == INT64_MAX) return -1;
  left = deadline - ember_now_ms();
  return left > 0 ? left : 0;
}

/* Grows the scratch buffer to at least cap bytes. */
static int client_scratch(ember_feed_client *c, size_t cap, const char *what) {
  if (cap <= c->scratch_cap) return EMBER_OK;
  uint8_t *nb = realloc(c->scratch, cap);
  if (nb == NULL) return ember__set_error(EMBER_ENOMEM, "feed %s: out of memory", what);
  c->scratch = nb;
  c->scratch_cap = cap;
  return EMBER_OK;
}

/* How long a producer whose ring was closed waits for the node's reason. */
#define FEED_REASON_WAIT_MS 2000

/* A ring operation failed.  When the node closed the ring, the reason (a
 * REFUSED frame, or the connection's end) is on the socket: report that. */
static int client_ring_failed(ember_feed_client *c, int rc, int64_t deadline, const char *what) {
  char ringmsg[512];
  int64_t d = ember_deadline_after(FEED_REASON_WAIT_MS);
  c->broken = 1;
  snprintf(ringmsg, sizeof ringmsg, "%s", ember_last_error());
  if (rc != EMBER_ECLOSED)
    return ember__set_error(rc, "feed %s to %s (partition %u): %s", what, c->peer, c->partition,
                            ringmsg);
  if (d > deadline) d = deadline;
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    int r = ember_sec_recv_frame(c->sec, c->fd, FEED_CLIENT_MAX_FRAME, &fh, &payload, d);
    if (r == EMBER_ECLOSED)
      return ember__set_error(EMBER_ECLOSED, "feed %s: node %s closed the connection "
                              "(partition %u; %s)", what, c->peer, c->partition, ringmsg);
    if (r != EMBER_OK) break; /* no word from the node: the ring's reason stands */
    if (fh.type == EMBER_MSG_REFUSED) {
      r = client_status(c, fh.type, payload, fh.length);
      free(payload);
      return r;
    }
    if (fh.type == EMBER_MSG_RESULTS && (c->flags & EMBER_FEED_WANT_RESULTS)) {
      if (client_keep_result(c, payload, fh.length, what) != EMBER_OK) return EMBER_ENOMEM;
      continue;
    }
    free(payload);
  }
  return ember__set_error(EMBER_ECLOSED, "feed %s to %s (partition %u): %s", what, c->peer,
                          c->partition, ringmsg);
}

/* Before sending more, looks (without blocking) for a REFUSED the server
 * sent because of an earlier batch, so the producer stops early with the
 * server's reason instead of streaming into a closing connection.  RESULTS
 * frames are left for recv_results. */
static int client_check_refused(ember_feed_client *c, int64_t deadline) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  ember_frame_header fh;
  uint8_t *payload = NULL;
  ssize_t n;
  int rc = EMBER_OK;
  if (ember_sec_pending(c->sec) == 0 && poll(&pfd, 1, 0) <= 0) goto cleanup;
  if (c->sec != NULL) {
    long k = ember_sec_peek(c->sec, c->fd, hdr, sizeof hdr);
    if (k < 0 && k != EMBER_ECLOSED) {
      c->broken = 1;
      rc = (int)k; /* altered in transit: the message names the server */
      goto cleanup;
    }
    n = k == EMBER_ECLOSED ? 0 : k == 0 ? -1 : (ssize_t)k;
  } else {
    n = recv(c->fd, hdr, sizeof hdr, MSG_PEEK | MSG_DONTWAIT);
  }
  if (n == 0) {
    c->broken = 1;
    rc = ember__set_error(EMBER_ECLOSED, "feed send to %s (partition %u): server closed the "
                          "connection", c->peer, c->partition);
    goto cleanup;
  }
  if (n < (ssize_t)sizeof hdr) goto cleanup; /* nothing whole yet, or an error send will see */
  /* Judge only the type here (a big RESULTS header is fine); a bad header is
   * left for recv_results or end_partition to report. */
  if (ember_wire_get_u32(hdr) != EMBER_WIRE_MAGIC) goto cleanup;
  fh.type = (uint16_t)(hdr[6] | hdr[7] << 8);
  if (fh.type != EMBER_MSG_REFUSED && fh.type != EMBER_MSG_ACK) goto cleanup;
  rc = ember_sec_recv_frame(c->sec, c->fd, FEED_CTL_MAX, &fh, &payload, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  rc = client_status(c, fh.type, payload, fh.length);
  if (rc == EMBER_OK) {
    /* An ACK nobody asked for is a protocol error too. */
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed: unexpected ACK from %s", c->peer);
  }
cleanup:
  free(payload);
  return rc;
}

/* The first send offers a ring (feed.h).  EMBER_OK whether or not the node
 * took it (c->ring says); an error only if the connection failed. */
static int client_offer_shm(ember_feed_client *c, int64_t deadline) {
  uint8_t req[FEED_SHM_REQ_LEN];
  ember_shm_ring *ring = NULL;
  ember_shm_ring_desc d;
  int rc = EMBER_OK;
  c->shm_decided = 1;
  if (!c->shm_wanted) goto cleanup;
  if (ember_shm_ring_create(&ring, c->shm_bytes, EMBER_SHM_PRODUCER) != EMBER_OK)
    goto cleanup; /* no memfd here: TCP */
  ember_shm_ring_describe(ring, &d);
  ember__feed_host_id(req);
  ember_shm_ring_desc_encode(&d, req + 16);
  rc = ember_sec_send_frame(c->sec, c->fd, EMBER_MSG_FEED_SHM, req, sizeof req, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    rc = client_recv(c, &fh, &payload, deadline, "send");
    if (rc != EMBER_OK) {
      c->broken = 1; /* a late reply would be misread */
      goto cleanup;
    }
    if (fh.type == EMBER_MSG_FEED_SHM_REPLY) {
      ember_wire_reader r;
      char reason[FEED_REASON_MAX + 1];
      uint32_t st;
      ember_wire_reader_init(&r, payload, fh.length);
      st = ember_wire_read_u32(&r);
      ember_wire_read_str(&r, reason, sizeof reason);
      rc = ember_wire_reader_finish(&r, 1, "FEED_SHM_REPLY");
      free(payload);
      if (rc != EMBER_OK) {
        c->broken = 1;
        goto cleanup;
      }
      if (st == 0) { /* attached: the ring is ours to write */
        c->ring = ring;
        ring = NULL;
      }
      goto cleanup; /* declined (reason says why): TCP */
    }
    if (fh.type == EMBER_MSG_REFUSED) {
      rc = client_status(c, fh.type, payload, fh.length);
      free(payload);
      goto cleanup;
    }
    free(payload);
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed send: expected FEED_SHM_REPLY from %s, got %s",
                          c->peer, ember_wire_type_name(fh.type));
    goto cleanup;
  }
cleanup:
  ember_shm_ring_destroy(ring);
  return rc;
}

int ember_feed_client_uses_shm(const ember_feed_client *c) { return c != NULL && c->ring != NULL; }

size_t ember_feed_client_in_place_max(const ember_feed_client *c) {
  if (c == NULL || c->ring == NULL) return 0;
  return ember_shm_ring_capacity(c->ring) / 2 - EMBER_SHM_RING_RECORD_HDR;
}

/* What send and begin_batch do first: drop a begun batch; check that the
 * client is usable, its partition open and not refused by the node, and the
 * batch laid out (with_data: its offsets and BOOL values checked too) and
 * within a frame; choose the transport on the first batch. */
static int client_prepare(ember_feed_client *c, const char *what, const ember_column *cols,
                          uint32_t ncols, uint32_t nrows, int with_data, int64_t deadline,
                          size_t *desc_end, size_t *total) {
  int rc = client_usable(c, what);
  if (rc != EMBER_OK) return rc;
  c->pending = PENDING_NONE;
  if (c->ended || c->end_sent)
    return ember__set_error(EMBER_ESTATE, "feed %s: partition %u already ended", what,
                            c->partition);
  rc = client_check_refused(c, deadline);
  if (rc != EMBER_OK) return rc;
  rc = with_data ? ember__batch_layout(cols, ncols, nrows, desc_end, total)
                 : ember__batch_shape_layout(cols, ncols, nrows, 0, desc_end, total);
  if (rc != EMBER_OK) return rc;
  if (*total > EMBER_WIRE_ABSOLUTE_MAX)
    return ember__set_error(EMBER_ETOOBIG, "feed %s: batch of %zu bytes exceeds the %u-byte "
                            "frame limit", what, *total, EMBER_WIRE_ABSOLUTE_MAX);
  return c->shm_decided ? EMBER_OK : client_offer_shm(c, deadline);
}

int ember_feed_client_send(ember_feed_client *c, const ember_column *cols, uint32_t ncols,
                           uint32_t nrows, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  static const uint8_t zeros[8] = {0};
  size_t desc_end = 0, total = 0, hlen, pos, niov = 0;
  int rc = client_prepare(c, "send", cols, ncols, nrows, 1, deadline, &desc_end, &total);
  if (rc != EMBER_OK) goto cleanup;
  if (c->ring && total <= ember_feed_client_in_place_max(c)) {
    /* Encoded straight into ring memory: the only copy of the columns. */
    void *w = NULL;
    rc = ember_shm_ring_reserve(c->ring, total, &w, ms_left(deadline));
    if (rc == EMBER_OK) {
      ember__batch_encode_checked(cols, ncols, nrows, desc_end, w);
      rc = ember_shm_ring_commit(c->ring, total);
    }
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "send");
      goto cleanup;
    }
    c->rows_sent += nrows;
    goto cleanup;
  }
  /* Frame header, batch header, descriptors and the padding after them go
   * in one small buffer; column bodies are sent from the caller's memory. */
  hlen = EMBER_WIRE_HEADER_LEN + ((desc_end + 7u) & ~(size_t)7u);
  rc = client_scratch(c, hlen, "send");
  if (rc != EMBER_OK) goto cleanup;
  if ((size_t)ncols * 3u + 1u > c->iov_cap) {
    struct iovec *ni = realloc(c->iov, ((size_t)ncols * 3u + 1u) * sizeof *ni);
    if (ni == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "feed send: out of memory");
      goto cleanup;
    }
    c->iov = ni;
    c->iov_cap = (size_t)ncols * 3u + 1u;
  }
  ember_wire_encode_header(c->scratch, EMBER_MSG_BATCH, (uint32_t)total);
  ember__batch_write_descriptors(cols, ncols, nrows, c->scratch + EMBER_WIRE_HEADER_LEN);
  memset(c->scratch + EMBER_WIRE_HEADER_LEN + desc_end, 0,
         hlen - EMBER_WIRE_HEADER_LEN - desc_end);
  c->iov[niov++] = (struct iovec){c->scratch, hlen};
  pos = hlen - EMBER_WIRE_HEADER_LEN;
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *col = &cols[i];
    size_t pad = ((pos + 7u) & ~(size_t)7u) - pos;
    if (pad) c->iov[niov++] = (struct iovec){(void *)(uintptr_t)zeros, pad};
    pos += pad;
    if (col->dtype == EMBER_DT_BYTES) {
      size_t olen = ((size_t)nrows + 1u) * 8u; /* offsets are little-endian in memory */
      c->iov[niov++] = (struct iovec){(void *)(uintptr_t)col->offsets, olen};
      pos += olen;
    }
    if (col->data_len) {
      c->iov[niov++] = (struct iovec){(void *)(uintptr_t)col->data, (size_t)col->data_len};
      pos += (size_t)col->data_len;
    }
  }
  if (c->ring) {
    /* Over half the ring: gathered from the columns into a split message
     * (the frame header stays out: the ring has its own framing). */
    c->iov[0].iov_base = c->scratch + EMBER_WIRE_HEADER_LEN;
    c->iov[0].iov_len = hlen - EMBER_WIRE_HEADER_LEN;
    rc = ember_shm_ring_sendv(c->ring, c->iov, (int)niov, ms_left(deadline));
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "send");
      goto cleanup;
    }
    c->rows_sent += nrows;
    goto cleanup;
  }
  for (size_t at = 0; at < niov; at += FEED_IOV_CHUNK) {
    size_t cnt = niov - at < FEED_IOV_CHUNK ? niov - at : FEED_IOV_CHUNK;
    rc = ember_sec_sendv_all(c->sec, c->fd, c->iov + at, (int)cnt, deadline);
    if (rc != EMBER_OK) {
      /* Part of a frame may be out: the stream cannot be resumed. */
      c->broken = 1;
      goto cleanup;
    }
  }
  c->rows_sent += nrows;
cleanup:
  return rc;
}

int ember_feed_client_begin_batch(ember_feed_client *c, const ember_column *cols,
                                  uint32_t ncols, uint32_t nrows, ember_batch_place *places,
                                  int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  size_t desc_end = 0, total = 0, end;
  uint8_t *buf = NULL;
  int rc;
  if (places == NULL && ncols > 0) {
    rc = ember__set_error(EMBER_EINVAL, "feed begin_batch: places is NULL");
    goto cleanup;
  }
  /* a second begin replaces the first */
  rc = client_prepare(c, "begin_batch", cols, ncols, nrows, 0, deadline, &desc_end, &total);
  if (rc != EMBER_OK) goto cleanup;
  if (ncols > c->pending_cols_cap) {
    ember_column *nc = realloc(c->pending_cols, (size_t)ncols * sizeof *nc);
    if (nc == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "feed begin_batch: out of memory");
      goto cleanup;
    }
    c->pending_cols = nc;
    c->pending_cols_cap = ncols;
  }
  if (c->ring && total <= ember_feed_client_in_place_max(c)) {
    void *w = NULL;
    rc = ember_shm_ring_reserve(c->ring, total, &w, ms_left(deadline));
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "begin_batch");
      goto cleanup;
    }
    buf = w;
    c->pending = PENDING_RING;
  } else {
    /* over half the ring, or TCP: built here, sent whole by commit */
    rc = client_scratch(c, BATCH_IN_SCRATCH + (total ? total : 1), "begin_batch");
    if (rc != EMBER_OK) goto cleanup;
    buf = c->scratch + BATCH_IN_SCRATCH;
    c->pending = PENDING_SCRATCH;
  }
  ember__batch_write_descriptors(cols, ncols, nrows, buf);
  end = desc_end;
  for (uint32_t i = 0; i < ncols; i++) {
    ember_column *pc = &c->pending_cols[i];
    end = ember__batch_place_column(&cols[i], nrows, buf, end, &places[i]);
    *pc = cols[i];
    pc->data = places[i].data;
    pc->offsets = places[i].offsets;
  }
  c->pending_buf = buf;
  c->pending_total = total;
  c->pending_ncols = ncols;
  c->pending_nrows = nrows;
cleanup:
  return rc;
}

void ember_feed_client_cancel_batch(ember_feed_client *c) {
  if (c != NULL) c->pending = PENDING_NONE;
}

int ember_feed_client_commit_batch(ember_feed_client *c, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  int pending, rc = client_usable(c, "commit_batch");
  if (rc != EMBER_OK) goto cleanup;
  pending = c->pending;
  c->pending = PENDING_NONE;
  if (pending == PENDING_NONE) {
    rc = ember__set_error(EMBER_ESTATE, "feed commit_batch: no batch begun");
    goto cleanup;
  }
  /* the caller filled the places: offsets and BOOL values are checked here,
   * as send checks them before sending */
  rc = ember__batch_check_content(c->pending_cols, c->pending_ncols, c->pending_nrows);
  if (rc != EMBER_OK) goto cleanup;
  if (pending == PENDING_RING) {
    rc = ember_shm_ring_commit(c->ring, c->pending_total);
  } else if (c->ring) {
    rc = ember_shm_ring_send(c->ring, c->pending_buf, c->pending_total, ms_left(deadline));
  } else {
    uint8_t *frame = c->pending_buf - EMBER_WIRE_HEADER_LEN;
    ember_wire_encode_header(frame, EMBER_MSG_BATCH, (uint32_t)c->pending_total);
    rc = ember_sec_send_all(c->sec, c->fd, frame, EMBER_WIRE_HEADER_LEN + c->pending_total, deadline);
    if (rc != EMBER_OK) {
      c->broken = 1; /* part of a frame may be out: the stream cannot be resumed */
      goto cleanup;
    }
  }
  if (rc != EMBER_OK) {
    rc = client_ring_failed(c, rc, deadline, "commit_batch");
    goto cleanup;
  }
  c->rows_sent += c->pending_nrows;
cleanup:
  return rc;
}

int ember_feed_client_recv_results(ember_feed_client *c, uint8_t **batch, size_t *len,
                                   int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  ember_frame_header fh;
  uint8_t *payload = NULL;
  int rc = EMBER_OK;
  if (c == NULL || batch == NULL || len == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "feed recv_results: NULL argument");
    goto cleanup;
  }
  *batch = NULL;
  *len = 0;
  if (c->res_head) { /* buffered during end_partition; hand out even if broken */
    pending_result *p = c->res_head;
    c->res_head = p->next;
    if (c->res_head == NULL) c->res_tail = NULL;
    *batch = p->data;
    *len = p->len;
    free(p);
    goto cleanup;
  }
  rc = client_usable(c, "recv_results");
  if (rc != EMBER_OK) goto cleanup;
  if (!(c->flags & EMBER_FEED_WANT_RESULTS)) {
    rc = ember__set_error(EMBER_ESTATE, "feed recv_results: partition %u did not ask for results",
                          c->partition);
    goto cleanup;
  }
  rc = client_recv(c, &fh, &payload, deadline, "recv_results");
  if (rc != EMBER_OK) goto cleanup;
  if (fh.type == EMBER_MSG_RESULTS) {
    /* malloc(0) may be NULL: give the caller a real (empty) buffer. */
    *batch = payload ? payload : malloc(1);
    *len = fh.length;
    payload = NULL;
    if (*batch == NULL) rc = ember__set_error(EMBER_ENOMEM, "feed recv_results: out of memory");
    goto cleanup;
  }
  if (fh.type == EMBER_MSG_REFUSED) {
    rc = client_status(c, fh.type, payload, fh.length);
    goto cleanup;
  }
  c->broken = 1;
  rc = ember__set_error(EMBER_EPROTO, "feed recv_results: expected RESULTS from %s, got %s",
                        c->peer, ember_wire_type_name(fh.type));
cleanup:
  free(payload);
  return rc;
}

/* Sends a control frame and waits for its ACK; RESULTS arriving meanwhile
 * are kept for recv_results when the producer asked for them. */
static int client_await_ack(ember_feed_client *c, int64_t deadline, const char *what);

static int client_request(ember_feed_client *c, uint16_t type, const uint8_t *p, uint32_t len,
                          int64_t timeout_ms, const char *what) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  int rc = ember_sec_send_frame(c->sec, c->fd, type, p, len, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    return rc;
  }
  return client_await_ack(c, deadline, what);
}

/* Reads up to the ACK (or REFUSED) of the request sent last, keeping the
 * RESULTS frames that come before it. */
static int client_await_ack(ember_feed_client *c, int64_t deadline, const char *what) {
  int rc;
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    rc = client_recv(c, &fh, &payload, deadline, what);
    if (rc != EMBER_OK) {
      if (rc == EMBER_ETIMEDOUT) c->broken = 1; /* an ACK may still come: stream is ambiguous */
      goto cleanup;
    }
    if (fh.type == EMBER_MSG_RESULTS && (c->flags & EMBER_FEED_WANT_RESULTS)) {
      rc = client_keep_result(c, payload, fh.length, what);
      if (rc != EMBER_OK) goto cleanup;
      continue;
    }
    if (fh.type == EMBER_MSG_ACK || fh.type == EMBER_MSG_REFUSED) {
      rc = client_status(c, fh.type, payload, fh.length);
      free(payload);
      goto cleanup;
    }
    free(payload);
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed %s: expected ACK from %s, got %s", what, c->peer,
                          ember_wire_type_name(fh.type));
    goto cleanup;
  }
cleanup:
  return rc;
}

/* With a ring: writes its END marker after the last batch (the node answers
 * only once its reader has reached it) and leaves in *timeout_ms what is
 * left of the deadline.  EMBER_OK at once without a ring. */
static int client_end_ring(ember_feed_client *c, int64_t *timeout_ms, const char *what) {
  int64_t deadline;
  int rc;
  if (c->ring == NULL) return EMBER_OK;
  deadline = ember__feed_deadline(*timeout_ms);
  rc = ember_shm_ring_end(c->ring, *timeout_ms);
  if (rc != EMBER_OK) return client_ring_failed(c, rc, deadline, what);
  *timeout_ms = ms_left(deadline);
  return EMBER_OK;
}

int ember_feed_client_end_partition_send(ember_feed_client *c, int64_t timeout_ms) {
  uint8_t cnt[8];
  int rc = client_usable(c, "end_partition");
  if (rc != EMBER_OK) goto cleanup;
  c->pending = PENDING_NONE; /* a begun batch is dropped */
  if (c->ended || c->end_sent) {
    rc = ember__set_error(EMBER_ESTATE, "feed end_partition: partition %u already ended",
                          c->partition);
    goto cleanup;
  }
  ember_wire_put_u64(cnt, c->rows_sent);
  rc = client_end_ring(c, &timeout_ms, "end_partition");
  if (rc != EMBER_OK) goto cleanup;
  rc = ember_sec_send_frame(c->sec, c->fd, EMBER_MSG_END_PARTITION, cnt, sizeof cnt,
                            ember__feed_deadline(timeout_ms));
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  c->end_sent = 1;
cleanup:
  return rc;
}

int ember_feed_client_end_partition_wait(ember_feed_client *c, int64_t timeout_ms) {
  int rc = client_usable(c, "end_partition");
  if (rc != EMBER_OK) goto cleanup;
  if (!c->end_sent) {
    rc = ember__set_error(EMBER_ESTATE, "feed end_partition: partition %u %s", c->partition,
                          c->ended ? "already ended" : "was not ended (end_partition_send)");
    goto cleanup;
  }
  rc = client_await_ack(c, ember__feed_deadline(timeout_ms), "end_partition");
  /* Any answer ends the partition on this connection. */
  if (rc == EMBER_OK || !c->broken) {
    c->ended = 1;
    c->end_sent = 0;
  }
cleanup:
  return rc;
}

int ember_feed_client_end_partition(ember_feed_client *c, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  int rc = ember_feed_client_end_partition_send(c, timeout_ms);
  if (rc != EMBER_OK) return rc;
  return ember_feed_client_end_partition_wait(c, ms_left(deadline));
}

int ember_feed_client_end_feed(ember_feed_client *c, int64_t timeout_ms) {
  int rc = client_usable(c, "end_feed");
  if (rc != EMBER_OK) goto cleanup;
  c->pending = PENDING_NONE; /* a begun batch is dropped */
  if (c->ended || c->end_sent) {
    rc = ember__set_error(EMBER_ESTATE, "feed end_feed: this connection already ended");
    goto cleanup;
  }
  rc = client_end_ring(c, &timeout_ms, "end_feed");
  if (rc != EMBER_OK) goto cleanup;
  rc = client_request(c, EMBER_MSG_END_FEED, NULL, 0, timeout_ms, "end_feed");
  if (rc == EMBER_OK || !c->broken) c->ended = 1;
cleanup:
  return rc;
}

int ember_feed_client_fail(ember_feed_client *c, const char *reason, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
  int rc = client_usable(c, "fail");
  if (rc != EMBER_OK) goto cleanup;
  c->pending = PENDING_NONE; /* a begun batch is dropped */
  if (c->ended || c->end_sent) {
    rc = ember__set_error(EMBER_ESTATE, "feed fail: partition %u already ended", c->partition);
    goto cleanup;
  }
  if (reason == NULL) reason = "";
  if (c->ring) {
    rc = ember_shm_ring_fail(c->ring, EMBER_EIO, reason, timeout_ms);
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "fail");
    } else {
      /* Wait (up to the deadline) until the node has read the marker and
       * dropped the connection: closing at once would tear the ring down
       * before its reader reaches the marker, and the reason would be lost. */
      for (;;) {
        ember_frame_header fh;
        uint8_t *payload = NULL;
        int r = ember_sec_recv_frame(c->sec, c->fd, FEED_CLIENT_MAX_FRAME, &fh, &payload, deadline);
        free(payload);
        if (r != EMBER_OK) break;
      }
    }
  } else {
    ember_wire_writer w;
    char cut[FEED_REASON_MAX + 1];
    snprintf(cut, sizeof cut, "%s", reason);
    ember_wire_writer_init(&w);
    ember_wire_write_str(&w, cut);
    rc = w.err ? ember__set_error(w.err, "feed fail: out of memory")
               : ember_sec_send_frame(c->sec, c->fd, EMBER_MSG_FEED_ERROR, w.buf, (uint32_t)w.len,
                                      deadline);
    ember_wire_writer_free(&w);
  }
  /* Either way this connection is over: the node drops it. */
  c->broken = 1;
  c->ended = 1;
cleanup:
  return rc;
}

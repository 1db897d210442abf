/* rendezvous_common.c - the wake-up eventfd and thread start shared by the
 * rendezvous server and client (see rendezvous_internal.h). */
#include "rendezvous_internal.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "ember/error.h"

int ember__rdv_wakefd(int *out) {
  *out = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (*out < 0) return ember__set_errno(EMBER_ESYS, errno, "eventfd");
  return EMBER_OK;
}

void ember__rdv_wake(int fd) {
  uint64_t one = 1;
  /* A saturated counter already guarantees a wake-up; EAGAIN is fine. */
  ssize_t n = write(fd, &one, sizeof one);
  (void)n;
}

void ember__rdv_drain(int fd) {
  uint8_t buf[256];
  while (read(fd, buf, sizeof buf) > 0) {
  }
}

int ember__rdv_start_thread(pthread_t *t, void *(*fn)(void *), void *arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int err = pthread_create(t, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (err != 0) return ember__set_errno(EMBER_ESYS, err, "pthread_create");
  return EMBER_OK;
}

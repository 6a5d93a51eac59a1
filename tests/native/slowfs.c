/* A slow disk for the tests: a FUSE filesystem (the kernel's own protocol
 * on /dev/fuse, no library) holding one file, `disk.img`, whose reads and
 * writes go to a backing file after a delay, many at once. A loop device
 * over it (direct I/O, so each of its requests reaches us and they run in
 * parallel) is a host block device whose every request takes at least the
 * delay — as a slow array or a far network disk does — while serving as
 * many at once as are sent: where a short queue in front of it, not the
 * device, limits what gets done.
 *
 *   slowfs MOUNTPOINT BACKING DELAY_US [THREADS]
 *
 * Mounts, prints "slowfs: ready" and serves until the mount goes
 * (umount) or it is killed. SIGUSR1 re-reads the delay (µs) from the file
 * $SLOWFS_DELAY_FILE names: one disk made slow, then fast again. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ROOT_INO 1
#define FILE_INO 2
#define FILE_NAME "disk.img"
#define MAX_IO (1 << 20)
#define BUF (MAX_IO + 4096)

static int fuse_fd;
static int backing_fd;
static atomic_long delay_us;
static const char *delay_file;

static void reply(uint64_t unique, int error, const void *body, size_t len)
{
	struct fuse_out_header h = {
		.len = sizeof(h) + (error ? 0 : len),
		.error = -error,
		.unique = unique,
	};
	struct iovec iov[2] = { { &h, sizeof(h) }, { (void *)body, error ? 0 : len } };
	/* ENOENT: the request was interrupted; nothing to do. */
	if (writev(fuse_fd, iov, 2) < 0 && errno != ENOENT)
		perror("slowfs: reply");
}

static void attr_of(uint64_t ino, struct fuse_attr *a)
{
	struct stat st;
	memset(a, 0, sizeof(*a));
	a->ino = ino;
	a->nlink = 1;
	a->blksize = 4096;
	if (ino == ROOT_INO) {
		a->mode = S_IFDIR | 0755;
		a->nlink = 2;
		return;
	}
	fstat(backing_fd, &st);
	a->mode = S_IFREG | 0644;
	a->size = st.st_size;
	a->blocks = (st.st_size + 511) / 512;
}

static void wait_delay(void)
{
	long us = atomic_load(&delay_us);
	struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
	if (us > 0)
		nanosleep(&ts, NULL);
}

static void on_init(uint64_t unique, const struct fuse_init_in *in)
{
	struct fuse_init_out out = {
		.major = FUSE_KERNEL_VERSION,
		.minor = FUSE_KERNEL_MINOR_VERSION,
		.max_readahead = 0,
		/* Many reads at once, and direct I/O answered asynchronously:
		 * the loop device's requests overlap here as on a real array. */
		.flags = (in->flags & (FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_BIG_WRITES |
				       FUSE_MAX_PAGES)),
		.max_background = 256,
		.congestion_threshold = 192,
		.max_write = MAX_IO,
		.max_pages = MAX_IO / 4096,
	};
	reply(unique, 0, &out, sizeof(out));
}

static void on_lookup(uint64_t unique, uint64_t parent, const char *name)
{
	struct fuse_entry_out out;
	if (parent != ROOT_INO || strcmp(name, FILE_NAME)) {
		reply(unique, ENOENT, NULL, 0);
		return;
	}
	memset(&out, 0, sizeof(out));
	out.nodeid = FILE_INO;
	out.attr_valid = 3600;
	out.entry_valid = 3600;
	attr_of(FILE_INO, &out.attr);
	reply(unique, 0, &out, sizeof(out));
}

static void on_getattr(uint64_t unique, uint64_t ino)
{
	struct fuse_attr_out out;
	memset(&out, 0, sizeof(out));
	out.attr_valid = 3600;
	attr_of(ino, &out.attr);
	reply(unique, 0, &out, sizeof(out));
}

static void on_open(uint64_t unique, uint64_t ino)
{
	/* Past the page cache: each read of the file is ours to delay. */
	struct fuse_open_out out = { .fh = ino, .open_flags = ino == FILE_INO ? FOPEN_DIRECT_IO : 0 };
	reply(unique, 0, &out, sizeof(out));
}

static void on_read(uint64_t unique, const struct fuse_read_in *in, char *buf)
{
	size_t n = in->size > MAX_IO ? MAX_IO : in->size;
	ssize_t got;
	wait_delay();
	got = pread(backing_fd, buf, n, in->offset);
	if (got < 0)
		reply(unique, errno, NULL, 0);
	else
		reply(unique, 0, buf, got);
}

static void on_write(uint64_t unique, const struct fuse_write_in *in, const char *data)
{
	struct fuse_write_out out = { 0 };
	ssize_t put;
	wait_delay();
	put = pwrite(backing_fd, data, in->size, in->offset);
	if (put < 0) {
		reply(unique, errno, NULL, 0);
		return;
	}
	out.size = put;
	reply(unique, 0, &out, sizeof(out));
}

static void on_statfs(uint64_t unique)
{
	struct fuse_statfs_out out;
	memset(&out, 0, sizeof(out));
	out.st.bsize = 4096;
	out.st.frsize = 4096;
	out.st.namelen = 255;
	reply(unique, 0, &out, sizeof(out));
}

/* One request: its reply, or none (FORGET, INTERRUPT). */
static void handle(char *req, char *buf)
{
	struct fuse_in_header *h = (void *)req;
	void *arg = req + sizeof(*h);
	switch (h->opcode) {
	case FUSE_INIT: on_init(h->unique, arg); break;
	case FUSE_LOOKUP: on_lookup(h->unique, h->nodeid, arg); break;
	case FUSE_GETATTR: on_getattr(h->unique, h->nodeid); break;
	case FUSE_SETATTR: on_getattr(h->unique, h->nodeid); break;
	case FUSE_OPEN:
	case FUSE_OPENDIR: on_open(h->unique, h->nodeid); break;
	case FUSE_READ: on_read(h->unique, arg, buf); break;
	case FUSE_WRITE: on_write(h->unique, arg, (char *)arg + sizeof(struct fuse_write_in)); break;
	case FUSE_STATFS: on_statfs(h->unique); break;
	case FUSE_FSYNC:
		fdatasync(backing_fd);
		reply(h->unique, 0, NULL, 0);
		break;
	case FUSE_RELEASE:
	case FUSE_RELEASEDIR:
	case FUSE_FLUSH: reply(h->unique, 0, NULL, 0); break;
	case FUSE_FORGET:
	case FUSE_BATCH_FORGET:
	case FUSE_INTERRUPT: break;
	case FUSE_DESTROY: reply(h->unique, 0, NULL, 0); break;
	default: reply(h->unique, ENOSYS, NULL, 0); break;
	}
}

static void *serve(void *unused)
{
	char *req = malloc(BUF), *buf = malloc(MAX_IO);
	(void)unused;
	for (;;) {
		ssize_t n = read(fuse_fd, req, BUF);
		if (n < 0) {
			if (errno == EINTR || errno == ENOENT || errno == EAGAIN)
				continue;
			/* ENODEV: unmounted. */
			exit(0);
		}
		handle(req, buf);
	}
	return NULL;
}

static void reread_delay(int sig)
{
	char text[32] = { 0 };
	int fd;
	(void)sig;
	if (!delay_file || (fd = open(delay_file, O_RDONLY)) < 0)
		return;
	if (read(fd, text, sizeof(text) - 1) > 0)
		atomic_store(&delay_us, atol(text));
	close(fd);
}

int main(int argc, char **argv)
{
	char opts[128];
	int threads = argc > 4 ? atoi(argv[4]) : 64;
	if (argc < 4) {
		fprintf(stderr, "usage: slowfs MOUNTPOINT BACKING DELAY_US [THREADS]\n");
		return 2;
	}
	atomic_store(&delay_us, atol(argv[3]));
	delay_file = getenv("SLOWFS_DELAY_FILE");
	signal(SIGUSR1, reread_delay);
	backing_fd = open(argv[2], O_RDWR);
	fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
	if (backing_fd < 0 || fuse_fd < 0) {
		perror("slowfs: open");
		return 1;
	}
	snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other",
		 fuse_fd);
	if (mount("slowfs", argv[1], "fuse.slowfs", MS_NOSUID | MS_NODEV, opts)) {
		perror("slowfs: mount");
		return 1;
	}
	for (int i = 1; i < threads; i++) {
		pthread_t t;
		pthread_create(&t, NULL, serve, NULL);
	}
	printf("slowfs: ready\n");
	fflush(stdout);
	serve(NULL);
	return 0;
}

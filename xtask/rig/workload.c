// SPDX-License-Identifier: Apache-2.0
/*
 * The rig guest's workload: O_DIRECT 4 KiB random (randread, randwrite) or
 * sequential (read, write) I/O on a block device at a fixed queue depth, through Linux AIO (raw syscalls, so it links
 * statically with nothing but libc). Prints one line:
 *   IOSPAN-WORKLOAD {"dev":…,"rw":…,"qd":…,"jobs":…,"bytes":…,"ios":…,"errors":…,"mean_us":…,
 *                    "p50_us":…,"p90_us":…,"p99_us":…,"p999_us":…,"max_us":…}
 * where ios is the exact number of I/Os completed and the latencies are
 * per I/O, submission to reaped completion, as the guest observed them.
 * With -l it first prints each I/O, in completion order:
 *   IOSPAN-IO OFFSET LATENCY_NS
 * With -b BYTES each request is that large (a multiple of 4 KiB, up to 1 MiB).
 * With -j N, N jobs (processes) share the I/Os, job k pinned to CPU k (so
 * to the block layer's queue of that CPU) and on the k-th slice of the
 * disk; the line covers them all.
 * With -x MS the I/O goes through a device-mapper "delay" target stacked on
 * the disk (reads and writes held MS milliseconds in the guest), set up
 * here with the device-mapper ioctls (no dmsetup in the initramfs).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/dm-ioctl.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#define BS 4096 /* alignment, and the default request size */
#define MAX_BS (1 << 20)
#define MAX_QD 256
#define MAX_JOBS 64

static long io_setup_(unsigned n, aio_context_t *ctx) { return syscall(SYS_io_setup, n, ctx); }
static long io_submit_(aio_context_t ctx, long n, struct iocb **iocbs) { return syscall(SYS_io_submit, ctx, n, iocbs); }
static long io_getevents_(aio_context_t ctx, long min, long max, struct io_event *ev)
{
	return syscall(SYS_io_getevents, ctx, min, max, ev, NULL);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

/* One device-mapper ioctl: the header, then (for a table load) one target
 * spec and its parameters. */
static int dm_ioctl_(int ctl, unsigned long cmd, struct dm_ioctl *io, const char *name)
{
	io->version[0] = DM_VERSION_MAJOR;
	io->version[1] = 0;
	io->version[2] = 0;
	if (!io->data_size)
		io->data_size = sizeof(*io);
	io->data_start = sizeof(*io);
	snprintf(io->name, sizeof(io->name), "%s", name);
	return ioctl(ctl, cmd, io);
}

/* Stacks "delay" (ms on reads and writes) on dev; returns the new device's
 * path in out. */
static int dm_delay(const char *dev, long ms, char *out, size_t outlen)
{
	const char *name = "iospan-delay";
	int fd = open(dev, O_RDONLY), ctl = open("/dev/mapper/control", O_RDWR);
	uint64_t size = 0;

	if (fd < 0 || ctl < 0 || ioctl(fd, BLKGETSIZE64, &size)) {
		fprintf(stderr, "workload: dm-delay on %s: %s\n", dev, strerror(errno));
		return -1;
	}
	close(fd);
	struct dm_ioctl create = {0};
	if (dm_ioctl_(ctl, DM_DEV_CREATE, &create, name)) {
		fprintf(stderr, "workload: DM_DEV_CREATE: %s\n", strerror(errno));
		return -1;
	}
	struct {
		struct dm_ioctl io;
		struct dm_target_spec spec;
		char params[256];
	} load = {0};
	load.io.data_size = sizeof(load);
	load.io.target_count = 1;
	load.spec.sector_start = 0;
	load.spec.length = size / 512;
	snprintf(load.spec.target_type, sizeof(load.spec.target_type), "delay");
	snprintf(load.params, sizeof(load.params), "%s 0 %ld", dev, ms);
	load.spec.next = 0;
	if (dm_ioctl_(ctl, DM_TABLE_LOAD, &load.io, name)) {
		fprintf(stderr, "workload: DM_TABLE_LOAD delay %s: %s\n", load.params, strerror(errno));
		return -1;
	}
	struct dm_ioctl resume = {0};
	if (dm_ioctl_(ctl, DM_DEV_SUSPEND, &resume, name)) {
		fprintf(stderr, "workload: resuming %s: %s\n", name, strerror(errno));
		return -1;
	}
	close(ctl);
	snprintf(out, outlen, "/dev/dm-%u", minor(resume.dev));
	for (int i = 0; i < 100 && access(out, F_OK); i++)
		usleep(10000);
	return 0;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
/* Bytes per request (-b): 4 KiB unless asked. */
static long bs = BS;
static uint64_t next_rand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Nearest rank: the ceil(n*permille/1000)-th smallest. */
static double pct(const uint64_t *v, long n, long permille)
{
	long i = (n * permille + 999) / 1000 - 1;

	if (i < 0)
		i = 0;
	if (i >= n)
		i = n - 1;
	return v[i] / 1000.0;
}

/* qd I/Os in flight on blocks [first, first + blocks) until ios are done:
 * each one's offset and latency into offs and lat, failed ones counted in
 * *errs. Returns the number done, -1 on failure. */
static long run(int fd, int write, int sequential, long qd, uint64_t first, uint64_t blocks, long ios,
		uint64_t *lat, uint64_t *offs, long *errs)
{
	aio_context_t ctx = 0;
	if (io_setup_(qd, &ctx)) {
		fprintf(stderr, "workload: io_setup: %s\n", strerror(errno));
		return -1;
	}
	static struct iocb cbs[MAX_QD];
	static struct io_event evs[MAX_QD];
	static uint64_t started[MAX_QD];
	char *bufs;
	if (posix_memalign((void **)&bufs, BS, (size_t)qd * bs))
		return -1;
	memset(bufs, 0x5a, (size_t)qd * bs);
	uint64_t next_block = 0;
	long submitted = 0, done = 0, errors = 0;

	for (;;) {
		/* Keep qd in flight until ios have been submitted. */
		struct iocb *batch[MAX_QD];
		long n = 0;
		for (long slot = 0; slot < qd && submitted + n < ios; slot++) {
			if (cbs[slot].aio_data)
				continue;
			struct iocb *cb = &cbs[slot];
			memset(cb, 0, sizeof(*cb));
			cb->aio_data = slot + 1;
			cb->aio_fildes = fd;
			cb->aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
			cb->aio_buf = (uint64_t)(uintptr_t)(bufs + slot * bs);
			cb->aio_nbytes = bs;
			cb->aio_offset = (int64_t)((first + (sequential ? next_block++ : next_rand()) % blocks) * bs);
			batch[n++] = cb;
		}
		/* Sequential I/O is submitted one call per I/O: one call's batch
		 * is merged by the guest's own block layer, while separate ones
		 * reach the device as separate requests, adjacent ones in flight
		 * together (for the host to merge, or not). An I/O's clock starts
		 * at its submitting call, as the reaping call's return ends it:
		 * preparing a batch is not the I/O's time. */
		for (long i = 0; i < n; i += sequential ? 1 : n) {
			long want = sequential ? 1 : n;
			uint64_t t0 = now_ns();
			for (long j = i; j < i + want; j++)
				started[batch[j]->aio_data - 1] = t0;
			long r = io_submit_(ctx, want, batch + i);
			if (r != want) {
				fprintf(stderr, "workload: io_submit: %ld of %ld (%s)\n", r, want, strerror(errno));
				return -1;
			}
		}
		submitted += n;
		if (done == ios)
			break;
		long got = io_getevents_(ctx, 1, qd, evs);
		if (got < 0) {
			if (errno == EINTR)
				continue;
			fprintf(stderr, "workload: io_getevents: %s\n", strerror(errno));
			return -1;
		}
		uint64_t t = now_ns();
		for (long i = 0; i < got; i++) {
			long slot = (long)evs[i].data - 1;
			if (evs[i].res != bs)
				errors++;
			offs[done] = (uint64_t)cbs[slot].aio_offset;
			lat[done++] = t - started[slot];
			cbs[slot].aio_data = 0;
		}
	}
	*errs = errors;
	return done;
}

int main(int argc, char **argv)
{
	const char *dev = "/dev/vda", *rw = "randread";
	long qd = 1, ios = 1000, delay_ms = -1, per_io = 0, jobs = 1;
	static char dm_path[64];
	int opt;

	while ((opt = getopt(argc, argv, "d:q:n:w:x:lj:b:")) != -1) {
		switch (opt) {
		case 'd': dev = optarg; break;
		case 'q': qd = atol(optarg); break;
		case 'n': ios = atol(optarg); break;
		case 'w': rw = optarg; break;
		case 'x': delay_ms = atol(optarg); break;
		case 'l': per_io = 1; break;
		case 'j': jobs = atol(optarg); break;
		case 'b': bs = atol(optarg); break;
		default:
			fprintf(stderr, "usage: %s -d DEV -q QD -n IOS -w randread|randwrite|read|write [-x DELAY_MS] [-l] [-j JOBS] [-b BYTES]\n", argv[0]);
			return 2;
		}
	}
	if (qd < 1 || qd > MAX_QD || ios < 1 || jobs < 1 || jobs > MAX_JOBS || jobs > ios ||
	    bs < BS || bs > MAX_BS || bs % BS) {
		fprintf(stderr, "workload: qd must be 1..%d, ios >= 1, jobs 1..%d and at most ios, "
			"bytes a multiple of %d up to %d\n", MAX_QD, MAX_JOBS, BS, MAX_BS);
		return 2;
	}
	if (delay_ms >= 0) {
		if (dm_delay(dev, delay_ms, dm_path, sizeof(dm_path)))
			return 1;
		dev = dm_path;
	}
	int write = strcmp(rw, "randwrite") == 0 || strcmp(rw, "write") == 0;
	int sequential = strcmp(rw, "read") == 0 || strcmp(rw, "write") == 0;
	int fd = open(dev, (write ? O_RDWR : O_RDONLY) | O_DIRECT);
	if (fd < 0) {
		fprintf(stderr, "workload: open %s: %s\n", dev, strerror(errno));
		return 1;
	}
	uint64_t size = 0;
	if (ioctl(fd, BLKGETSIZE64, &size) || size < 16 * (uint64_t)bs) {
		fprintf(stderr, "workload: %s: size %llu too small\n", dev, (unsigned long long)size);
		return 1;
	}
	uint64_t blocks = size / bs;
	/* Results in memory the jobs share: each fills its own slice. */
	uint64_t *lat = mmap(NULL, ios * sizeof(*lat), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	uint64_t *offs = mmap(NULL, ios * sizeof(*offs), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	long *errs = mmap(NULL, MAX_JOBS * sizeof(*errs), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (lat == MAP_FAILED || offs == MAP_FAILED || errs == MAP_FAILED) {
		fprintf(stderr, "workload: mmap: %s\n", strerror(errno));
		return 1;
	}
	long done = 0, errors = 0;
	if (jobs == 1) {
		done = run(fd, write, sequential, qd, 0, blocks, ios, lat, offs, &errs[0]);
	} else {
		/* Job k on CPU k (its block-layer queue), on the k-th slice of the
		 * disk, doing its share of the I/Os. */
		long base = 0;
		pid_t pids[MAX_JOBS];
		for (long k = 0; k < jobs; k++) {
			long n = ios / jobs + (k < ios % jobs);
			uint64_t first = blocks * k / jobs, span = blocks * (k + 1) / jobs - first;
			pids[k] = fork();
			if (pids[k] < 0) {
				fprintf(stderr, "workload: fork: %s\n", strerror(errno));
				return 1;
			}
			if (pids[k] == 0) {
				cpu_set_t cpus;

				CPU_ZERO(&cpus);
				CPU_SET(k, &cpus);
				if (sched_setaffinity(0, sizeof(cpus), &cpus)) {
					fprintf(stderr, "workload: job %ld on CPU %ld: %s\n", k, k, strerror(errno));
					_exit(1);
				}
				rng += (uint64_t)(k + 1) * 0x2545F4914F6CDD1Dull;
				if (!rng)
					rng = 1;
				_exit(run(fd, write, sequential, qd, first, span, n, lat + base, offs + base, &errs[k]) == n ? 0 : 1);
			}
			base += n;
		}
		done = ios;
		for (long k = 0; k < jobs; k++) {
			int st = 0;

			if (waitpid(pids[k], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
				fprintf(stderr, "workload: job %ld failed\n", k);
				return 1;
			}
		}
	}
	if (done != ios)
		return 1;
	for (long k = 0; k < jobs; k++)
		errors += errs[k];
	for (long i = 0; per_io && i < ios; i++)
		printf("IOSPAN-IO %llu %llu\n", (unsigned long long)offs[i], (unsigned long long)lat[i]);
	qsort(lat, ios, sizeof(*lat), cmp_u64);
	double sum = 0;
	for (long i = 0; i < ios; i++)
		sum += lat[i];
	printf("IOSPAN-WORKLOAD {\"dev\":\"%s\",\"rw\":\"%s\",\"qd\":%ld,\"jobs\":%ld,\"bytes\":%ld,\"ios\":%ld,\"errors\":%ld,"
	       "\"mean_us\":%.3f,\"p50_us\":%.3f,\"p90_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":%.3f,\"max_us\":%.3f}\n",
	       dev, rw, qd, jobs, bs, done, errors, sum / ios / 1000.0, pct(lat, ios, 500), pct(lat, ios, 900),
	       pct(lat, ios, 990), pct(lat, ios, 999), lat[ios - 1] / 1000.0);
	fflush(stdout);
	return errors ? 1 : 0;
}

/* A KVM virtual machine at production rates, for `cargo xtask bench vm`
 * and the tests: one process per VM, named as QEMU's, with Q virtqueues.
 * Each queue has its own vCPU thread ("CPU <q>/KVM") acting as the guest's
 * driver: it keeps D requests available in the queue's ring, and kicks the
 * queue by running guest code that writes the queue's notify address
 * (NOTIFY_GPA + 4q, KVM_IOEVENTFD: an MMIO write KVM turns into an eventfd
 * signal in the kernel) unless the engine has suppressed notifications.
 *
 * The engine (the main thread, as QEMU's main loop or an iothread) waits on
 * the queues' notifiers and the completion eventfd of its io_uring, reads a
 * notifier as QEMU does (a 512-byte read), pops the queue's available
 * requests and submits each as a 4 KiB O_DIRECT read of the disk; each
 * completion is pushed to the used ring by calling virtqueue_flush (where
 * iospan's probe attaches, as on QEMU's) and the queue is signalled through
 * its irqfd (an MSI route of the in-kernel irqchip).
 *
 * Under `-accel tcg` (QEMU's software emulation, for a kernel without KVM)
 * there is no KVM: the vCPU threads ("CPU <q>/TCG") kick by writing the
 * queue's eventfd themselves, as QEMU's emulated notify write does, and the
 * engine raises a queue's interrupt by calling msix_notify (probed as on
 * QEMU's), as QEMU's emulated interrupt controller takes it in user space.
 *
 * With IOSPAN_VM_POLL_NS > 0 the engine is an iothread ("IO iothread0")
 * and polls as QEMU's do (poll-max-ns): after work it suppresses the
 * queues' notifications and
 * spins on their rings for that long before it re-enables them and
 * sleeps, so most requests arrive with no kick at all.
 *
 * Arguments, QEMU-style: -name guest=NAME,... -drive file=DISK,...
 * -accel kvm|tcg (default kvm); only those are read. Environment:
 *   IOSPAN_VM_QUEUES   queues (default 1, at most 64)
 *   IOSPAN_VM_QD       requests in flight per queue (default 32)
 *   IOSPAN_VM_IOS      requests per queue, then exit (default 1000), or
 *   IOSPAN_VM_SECONDS  run this long instead
 *   IOSPAN_VM_POLL_NS  poll this long before sleeping (default 0: event-driven)
 *   IOSPAN_VM_DELAY_MS wait this long before the device starts (default 500),
 *                      as a guest's firmware and boot would
 *   IOSPAN_VM_NOTIFY_STRIDE  bytes between the queues' notify addresses
 *                      (default 4, virtio-pci's; 4096: a page per queue,
 *                      QEMU's page-per-vq=on)
 *   IOSPAN_VM_LOG      write one line per request: queue, number, offset,
 *                      when it was made available, when the engine popped it,
 *                      when the engine began reading the kick that led to
 *                      that pop (0: found by polling), when it pushed its
 *                      completion, when it raised its queue's interrupt
 *                      after (CLOCK_MONOTONIC ns);
 *                      offsets are then distinct
 *                      within the VM and never adjacent (the disk must hold
 *                      2 x Q x IOS blocks of 4 KiB past the offset below).
 *   IOSPAN_VM_OFFSET   with IOSPAN_VM_LOG: the first block of 4 KiB this VM
 *                      reads (VMs sharing a disk read disjoint ranges).
 * At exit it prints one line: "vm_load: NAME requests=N seconds=S iops=X
 * kicks=K q0=... q1=...". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <linux/io_uring.h>
#include <linux/kvm.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NOTIFY_GPA 0x1000 /* past the guest's one page of memory: an MMIO exit */
#define MAXQ 64
#define RING 1024 /* per queue; a power of two above any depth */
#define BUFS 16
#define BLOCK 4096

struct vq {
	_Atomic uint32_t avail_idx; /* the guest's */
	_Atomic uint32_t used_idx;  /* the engine's */
	_Atomic uint32_t no_notify; /* the engine: don't kick */
	_Atomic uint32_t waiting;   /* the guest sleeps on used_idx */
	uint32_t last_avail;        /* the engine's */
	uint64_t avail_ns[RING];
	uint32_t seq[RING];
	int kick, call, vcpu;
	struct kvm_run *run;
	long total; /* requests to make, or -1 until stopped */
	long made, done;
	uint64_t kicks;
	int finished;
	pthread_t thread;
	char pad[64];
};

struct logent {
	uint64_t avail_ns, pop_ns, read_ns, pos, push_ns, signal_ns;
};

static struct vq *vqs;
static int nq = 1, qd = 32, img, uring;
static long ios_per_q = 1000;
static long blocks, first_block;
static uint64_t poll_ns;
static uint64_t notify_stride = 4;
static _Atomic int stop, failed;
static int tcg; /* -accel tcg: no KVM */
static struct logent *logv; /* [q * ios_per_q + seq] */
/* The log entries of the completions one reap pushed. */
static struct logent *reaped[4 * RING];
static void *bufs;
/* Before a pop: when the engine began reading the kick it serves (0: the
 * pop is a poll's). */
static uint64_t kick_read_ns;
static int ep, done_efd;
static double seconds;
static uint64_t t0;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static int die(const char *what)
{
	fprintf(stderr, "vm_load: %s: %s\n", what, strerror(errno));
	return 1;
}

/* The engine pushing a completion to the used ring: the symbol iospan
 * probes (unoptimised: entered with a push, as QEMU's is). */
__attribute__((noinline, used, optimize("O0"))) void virtqueue_flush(void *vq, unsigned count)
{
	__asm__ volatile("" ::"r"(vq), "r"(count) : "memory");
}

/* QEMU raising a queue's MSI-X interrupt in user space (TCG): probed as
 * on QEMU's, unoptimised likewise. */
__attribute__((noinline, used, optimize("O0"))) void msix_notify(void *dev, unsigned vector)
{
	__asm__ volatile("" ::"r"(dev), "r"(vector) : "memory");
}

/* QEMU's merge accounting, probed beside the flush: this engine never
 * merges requests, so it is never called. */
__attribute__((noinline, used, optimize("O0"))) void block_acct_merge_done(void *stats, int type, int num_merged)
{
	__asm__ volatile("" ::"r"(stats), "r"(type), "r"(num_merged) : "memory");
}

/* ---- the guest's side ---- */

static void kick(struct vq *v, int q)
{
	struct kvm_regs regs = { .rip = 0, .rflags = 2, .rbx = NOTIFY_GPA + notify_stride * q };
	uint64_t one = 1;

	if (tcg) {
		/* QEMU's emulated notify write: event_notifier_set(). */
		if (write(v->kick, &one, sizeof(one)) != sizeof(one)) {
			fprintf(stderr, "vm_load: kick: %s\n", strerror(errno));
			failed = 1;
		}
		v->kicks++;
		return;
	}
	if (ioctl(v->vcpu, KVM_SET_REGS, &regs) < 0 || ioctl(v->vcpu, KVM_RUN, 0) < 0 ||
	    v->run->exit_reason != KVM_EXIT_IO) {
		fprintf(stderr, "vm_load: KVM_RUN: %s (exit %u)\n", strerror(errno), v->run->exit_reason);
		failed = 1;
	}
	v->kicks++;
}

static void *vcpu(void *arg)
{
	int q = (int)(intptr_t)arg;
	struct vq *v = &vqs[q];
	char name[16];
	uint32_t made = 0;

	snprintf(name, sizeof(name), tcg ? "CPU %d/TCG" : "CPU %d/KVM", q);
	prctl(PR_SET_NAME, name);
	if (tcg) {
		/* QEMU's queue notifier, made when the guest driver starts the
		 * device: in the vCPU thread. */
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = q };

		v->kick = eventfd(0, EFD_NONBLOCK);
		if (v->kick < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, v->kick, &ev) < 0) {
			fprintf(stderr, "vm_load: notifier: %s\n", strerror(errno));
			failed = 1;
			return NULL;
		}
	}
	for (;;) {
		uint32_t used = atomic_load_explicit(&v->used_idx, memory_order_acquire);
		int n = 0;

		while (made - used < (uint32_t)qd && !failed && (v->total < 0 ? !stop : made < v->total)) {
			uint32_t slot = made % RING;

			v->seq[slot] = made;
			v->avail_ns[slot] = now_ns();
			made++;
			n++;
		}
		if (n) {
			atomic_store(&v->avail_idx, made);
			if (!atomic_load(&v->no_notify))
				kick(v, q);
		}
		if (failed || (used == made && (v->total < 0 ? stop : made == v->total)))
			break;
		/* Wait for a completion, as a guest halts until its interrupt. */
		atomic_store(&v->waiting, 1);
		if (atomic_load(&v->used_idx) == used) {
			struct timespec ts = { 0, 100 * 1000 * 1000 };

			syscall(SYS_futex, &v->used_idx, FUTEX_WAIT_PRIVATE, used, &ts, NULL, 0);
		}
		atomic_store(&v->waiting, 0);
	}
	v->made = made;
	return NULL;
}

/* ---- the engine's io_uring, raw ---- */

static struct {
	unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
	unsigned *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
	unsigned pending; /* prepared, not yet submitted */
	unsigned inflight;
} ring;

static int uring_setup(unsigned entries, int efd)
{
	struct io_uring_params p = { 0 };
	void *sq, *cq;
	size_t sqsz, cqsz;

	uring = (int)syscall(__NR_io_uring_setup, entries, &p);
	if (uring < 0)
		return -1;
	sqsz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
	cqsz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	sq = mmap(NULL, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, uring, IORING_OFF_SQ_RING);
	cq = mmap(NULL, cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, uring, IORING_OFF_CQ_RING);
	ring.sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_POPULATE, uring, IORING_OFF_SQES);
	if (sq == MAP_FAILED || cq == MAP_FAILED || ring.sqes == MAP_FAILED)
		return -1;
	ring.sq_head = (unsigned *)((char *)sq + p.sq_off.head);
	ring.sq_tail = (unsigned *)((char *)sq + p.sq_off.tail);
	ring.sq_mask = (unsigned *)((char *)sq + p.sq_off.ring_mask);
	ring.sq_array = (unsigned *)((char *)sq + p.sq_off.array);
	ring.cq_head = (unsigned *)((char *)cq + p.cq_off.head);
	ring.cq_tail = (unsigned *)((char *)cq + p.cq_off.tail);
	ring.cq_mask = (unsigned *)((char *)cq + p.cq_off.ring_mask);
	ring.cqes = (struct io_uring_cqe *)((char *)cq + p.cq_off.cqes);
	return (int)syscall(__NR_io_uring_register, uring, IORING_REGISTER_EVENTFD, &efd, 1);
}

static void submit(void)
{
	while (ring.pending) {
		int n = (int)syscall(__NR_io_uring_enter, uring, ring.pending, 0, 0, NULL, 0);

		if (n < 0) {
			if (errno == EINTR || errno == EAGAIN || errno == EBUSY)
				continue;
			die("io_uring_enter");
			failed = 1;
			return;
		}
		ring.pending -= n;
	}
}

static uint64_t rnd(void)
{
	static uint64_t x = 88172645463325252ull;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return x;
}

/* Pops queue q's available requests into the submission ring. */
static int pop(int q)
{
	struct vq *v = &vqs[q];
	uint32_t avail = atomic_load_explicit(&v->avail_idx, memory_order_acquire);
	int n = 0;

	while (v->last_avail != avail) {
		uint32_t slot = v->last_avail % RING;
		unsigned tail = *ring.sq_tail, idx = tail & *ring.sq_mask;
		struct io_uring_sqe *sqe = &ring.sqes[idx];
		uint64_t pos;

		if (logv) {
			struct logent *l = &logv[q * ios_per_q + v->seq[slot]];

			/* Every other block: no two requests are adjacent, so
			 * none is merged into another. */
			pos = (first_block + ((uint64_t)q * ios_per_q + v->seq[slot]) * 2) * BLOCK;
			l->avail_ns = v->avail_ns[slot];
			l->pop_ns = now_ns();
			l->read_ns = kick_read_ns;
			l->pos = pos;
		} else
			pos = rnd() % blocks * BLOCK;
		memset(sqe, 0, sizeof(*sqe));
		sqe->opcode = IORING_OP_READ;
		sqe->fd = img;
		sqe->addr = (uint64_t)bufs + (v->last_avail % BUFS) * BLOCK;
		sqe->len = BLOCK;
		sqe->off = pos;
		sqe->user_data = ((uint64_t)q << 32) | slot;
		ring.sq_array[idx] = idx;
		atomic_store_explicit((_Atomic unsigned *)ring.sq_tail, tail + 1, memory_order_release);
		ring.pending++;
		ring.inflight++;
		v->last_avail++;
		n++;
	}
	return n;
}

/* Completions: each pushed to its queue's used ring, each queue touched
 * signalled once. */
static int reap(void)
{
	unsigned head = *ring.cq_head;
	unsigned tail = atomic_load_explicit((_Atomic unsigned *)ring.cq_tail, memory_order_acquire);
	uint64_t touched[MAXQ / 64] = { 0 };
	uint64_t one = 1;
	int n = 0;

	for (; head != tail; head++) {
		struct io_uring_cqe *c = &ring.cqes[head & *ring.cq_mask];
		int q = (int)(c->user_data >> 32);

		if (c->res != BLOCK) {
			fprintf(stderr, "vm_load: read: %s\n", c->res < 0 ? strerror(-c->res) : "short");
			failed = 1;
		}
		if (logv) {
			struct logent *l = &logv[q * ios_per_q + vqs[q].seq[(uint32_t)c->user_data]];

			l->push_ns = now_ns();
			reaped[n] = l;
		}
		vqs[q].done++;
		atomic_fetch_add(&vqs[q].used_idx, 1);
		virtqueue_flush(&vqs[q], 1);
		touched[q / 64] |= 1ull << (q % 64);
		ring.inflight--;
		n++;
	}
	atomic_store_explicit((_Atomic unsigned *)ring.cq_head, head, memory_order_release);
	for (int q = 0; q < nq; q++)
		if (touched[q / 64] & (1ull << (q % 64))) {
			if (logv) {
				/* When the interrupt of each request's queue was raised. */
				uint64_t t = now_ns();

				for (int i = 0; i < n; i++)
					if (reaped[i] >= &logv[q * ios_per_q] && reaped[i] < &logv[(q + 1) * ios_per_q])
						reaped[i]->signal_ns = t;
			}
			if (tcg)
				msix_notify(&vqs[q], (unsigned)q);
			else if (write(vqs[q].call, &one, sizeof(one)) != sizeof(one))
				failed = 1;
			if (atomic_load(&vqs[q].waiting))
				syscall(SYS_futex, &vqs[q].used_idx, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
		}
	return n;
}

static int all_done(void)
{
	for (int q = 0; q < nq; q++) {
		struct vq *v = &vqs[q];

		if (!v->finished)
			return 0;
	}
	return ring.inflight == 0;
}

static void set_notify(int on)
{
	for (int q = 0; q < nq; q++)
		atomic_store(&vqs[q].no_notify, !on);
}

/* Spins on the rings until nothing new came for poll_ns; notifications are
 * suppressed meanwhile and re-enabled after, with one last look so no
 * request made in between is left without a kick. */
static void poll_rings(void)
{
	uint64_t t0 = now_ns();

	set_notify(0);
	while (!failed) {
		int found = 0;

		for (int q = 0; q < nq; q++)
			found += pop(q);
		submit();
		found += reap();
		if (found)
			t0 = now_ns();
		else if (now_ns() - t0 > poll_ns)
			break;
	}
	set_notify(1);
	for (int q = 0; q < nq; q++)
		pop(q);
	submit();
}

/* The engine's loop: kicks and completions until every queue is done. */
static void *engine(void *name)
{
	if (name)
		prctl(PR_SET_NAME, name);
	while (!failed) {
		struct epoll_event evs[MAXQ + 1];
		int n;

		if (seconds > 0 && !stop && now_ns() - t0 >= (uint64_t)(seconds * 1e9))
			stop = 1;
		for (int q = 0; q < nq; q++) {
			struct vq *v = &vqs[q];

			/* A queue is finished once its guest has made its last
			 * request and every one is back. */
			if (!v->finished && (v->total < 0 ? stop : 1) &&
			    atomic_load(&v->used_idx) == (v->total < 0 ? atomic_load(&v->avail_idx) : (uint32_t)v->total) &&
			    (v->total >= 0 || pthread_tryjoin_np(v->thread, NULL) == 0)) {
				if (v->total >= 0)
					pthread_join(v->thread, NULL);
				v->finished = 1;
			}
		}
		if (all_done())
			break;
		n = epoll_wait(ep, evs, MAXQ + 1, 100);
		if (n < 0 && errno != EINTR) {
			die("epoll_wait");
			failed = 1;
			break;
		}
		for (int i = 0; i < n; i++) {
			uint8_t big[512];
			uint32_t q = evs[i].data.u32;

			if (q == MAXQ) {
				uint64_t c;

				if (read(done_efd, &c, sizeof(c)) < 0 && errno != EAGAIN) {
					die("completion eventfd");
					failed = 1;
				}
				continue;
			}
			/* As QEMU's loop: drain the notifier, then the queue,
			 * whose requests are submitted before the next handler
			 * runs (QEMU unplugs at the end of each). */
			kick_read_ns = now_ns();
			if (read(vqs[q].kick, big, sizeof(big)) < 0 && errno != EAGAIN) {
				die("notifier read");
				failed = 1;
			}
			pop((int)q);
			kick_read_ns = 0;
			submit();
		}
		submit();
		reap();
		if (poll_ns)
			poll_rings();
	}
	return NULL;
}

/* The VM: one page of guest code, a vCPU per queue. */
static int vm = -1;

static int kvm_setup(void)
{
	/* mov al, 1; mov [bx], al; out 0x10, al */
	static const uint8_t code[] = { 0xb0, 0x01, 0x88, 0x07, 0xe6, 0x10 };
	struct kvm_userspace_memory_region mem = { .slot = 0, .guest_phys_addr = 0, .memory_size = 0x1000 };
	uint8_t *ram;
	int kvm, sz;

	kvm = open("/dev/kvm", O_RDWR);
	if (kvm < 0)
		return die("/dev/kvm");
	vm = ioctl(kvm, KVM_CREATE_VM, 0);
	if (vm < 0)
		return die("KVM_CREATE_VM");
	ram = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (ram == MAP_FAILED)
		return die("guest memory");
	memcpy(ram, code, sizeof(code));
	mem.userspace_addr = (uint64_t)ram;
	if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &mem) < 0)
		return die("KVM_SET_USER_MEMORY_REGION");
	if (ioctl(vm, KVM_CREATE_IRQCHIP, 0) < 0)
		return die("KVM_CREATE_IRQCHIP");
	sz = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
	for (int q = 0; q < nq; q++) {
		struct vq *v = &vqs[q];
		struct kvm_sregs sregs;

		v->vcpu = ioctl(vm, KVM_CREATE_VCPU, q);
		if (v->vcpu < 0)
			return die("KVM_CREATE_VCPU");
		v->run = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, v->vcpu, 0);
		if (v->run == MAP_FAILED || ioctl(v->vcpu, KVM_GET_SREGS, &sregs) < 0)
			return die("vCPU state");
		sregs.cs.base = sregs.cs.selector = sregs.ds.base = sregs.ds.selector = 0;
		if (ioctl(v->vcpu, KVM_SET_SREGS, &sregs) < 0)
			return die("KVM_SET_SREGS");
		/* With the in-kernel irqchip a vCPU other than the first
		 * waits for a startup IPI; each runs its queue's code now. */
		{
			struct kvm_mp_state mp = { .mp_state = KVM_MP_STATE_RUNNABLE };

			if (ioctl(v->vcpu, KVM_SET_MP_STATE, &mp) < 0)
				return die("KVM_SET_MP_STATE");
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	const char *image = NULL, *name = "vm", *logpath = getenv("IOSPAN_VM_LOG");
	struct stat st;
	uint64_t t1, kicks = 0;
	long total = 0;

	for (int i = 1; i + 1 < argc; i++)
		if (!strcmp(argv[i], "-drive")) {
			char *f = strstr(argv[i + 1], "file=");

			if (f)
				image = strndup(f + 5, strcspn(f + 5, ","));
		} else if (!strcmp(argv[i], "-accel")) {
			tcg = !strncmp(argv[i + 1], "tcg", 3);
		} else if (!strcmp(argv[i], "-name")) {
			char *g = strstr(argv[i + 1], "guest=");

			name = g ? strndup(g + 6, strcspn(g + 6, ",")) : argv[i + 1];
		}
	if (getenv("IOSPAN_VM_QUEUES"))
		nq = atoi(getenv("IOSPAN_VM_QUEUES"));
	if (getenv("IOSPAN_VM_QD"))
		qd = atoi(getenv("IOSPAN_VM_QD"));
	if (getenv("IOSPAN_VM_IOS"))
		ios_per_q = atol(getenv("IOSPAN_VM_IOS"));
	if (getenv("IOSPAN_VM_SECONDS"))
		seconds = atof(getenv("IOSPAN_VM_SECONDS"));
	if (getenv("IOSPAN_VM_OFFSET"))
		first_block = atol(getenv("IOSPAN_VM_OFFSET"));
	if (getenv("IOSPAN_VM_POLL_NS"))
		poll_ns = strtoull(getenv("IOSPAN_VM_POLL_NS"), NULL, 10);
	if (getenv("IOSPAN_VM_NOTIFY_STRIDE"))
		notify_stride = strtoull(getenv("IOSPAN_VM_NOTIFY_STRIDE"), NULL, 10);
	if (!image) {
		fprintf(stderr, "vm_load: no -drive file=DISK\n");
		return 2;
	}
	if (nq < 1 || nq > MAXQ || qd < 1 || qd > RING / 2 || ios_per_q < 1) {
		fprintf(stderr, "vm_load: IOSPAN_VM_QUEUES must be 1-%d, IOSPAN_VM_QD 1-%d, IOSPAN_VM_IOS >= 1\n",
			MAXQ, RING / 2);
		return 2;
	}
	if (seconds > 0 && logpath) {
		fprintf(stderr, "vm_load: IOSPAN_VM_LOG needs IOSPAN_VM_IOS, not IOSPAN_VM_SECONDS\n");
		return 2;
	}
	img = open(image, O_RDONLY | O_DIRECT);
	if (img < 0 || fstat(img, &st) < 0)
		return die(image);
	blocks = (S_ISBLK(st.st_mode) ? lseek(img, 0, SEEK_END) : st.st_size) / BLOCK;
	if (blocks < 1 || first_block < 0 || (logpath && blocks < first_block + 2 * nq * ios_per_q)) {
		fprintf(stderr, "vm_load: %s: %ld blocks of 4 KiB, too small%s\n", image, blocks,
			logpath ? " for a distinct offset per request" : "");
		return 2;
	}
	if (logpath && !(logv = calloc((size_t)nq * ios_per_q, sizeof(*logv))))
		return die("log");
	if (posix_memalign(&bufs, BLOCK, BUFS * BLOCK))
		return die("buffers");
	vqs = aligned_alloc(64, sizeof(*vqs) * nq);
	if (!vqs)
		return die("queues");
	memset(vqs, 0, sizeof(*vqs) * nq);

	for (int q = 0; q < nq; q++)
		vqs[q].total = seconds > 0 ? -1 : ios_per_q;
	if (!tcg && kvm_setup() != 0)
		return 1;
	/* Give the host agent time to see this VM before its device starts,
	 * as a guest's boot would. */
	usleep((getenv("IOSPAN_VM_DELAY_MS") ? atol(getenv("IOSPAN_VM_DELAY_MS")) : 500) * 1000);
	done_efd = eventfd(0, EFD_NONBLOCK);
	ep = epoll_create1(0);
	if (done_efd < 0 || ep < 0 || uring_setup(4 * RING, done_efd) < 0)
		return die("io_uring");
	for (int q = 0; q < nq; q++) {
		struct vq *v = &vqs[q];
		struct kvm_ioeventfd notify = { .addr = NOTIFY_GPA + notify_stride * q, .len = 1 };
		struct {
			struct kvm_irq_routing r;
			struct kvm_irq_routing_entry e[MAXQ];
		} routes = { .r = { .nr = (unsigned)(q + 1) } };
		struct kvm_irqfd irqfd = { .gsi = 24 + q };
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = q };

		v->call = eventfd(0, 0);
		if (v->call < 0)
			return die("eventfd");
		if (tcg)
			continue; /* its notifier comes from its vCPU thread */
		v->kick = eventfd(0, EFD_NONBLOCK);
		notify.fd = v->kick;
		if (v->kick < 0)
			return die("eventfd");
		if (ioctl(vm, KVM_IOEVENTFD, &notify) < 0)
			return die("KVM_IOEVENTFD");
		/* Every queue's interrupt, as an MSI route (the table is set whole). */
		for (int r = 0; r <= q; r++) {
			routes.e[r].gsi = 24 + r;
			routes.e[r].type = KVM_IRQ_ROUTING_MSI;
			routes.e[r].u.msi.address_lo = 0xfee00000;
			routes.e[r].u.msi.data = 0x41 + r;
		}
		irqfd.fd = v->call;
		if (ioctl(vm, KVM_SET_GSI_ROUTING, &routes) < 0 || ioctl(vm, KVM_IRQFD, &irqfd) < 0)
			return die("irqfd");
		if (epoll_ctl(ep, EPOLL_CTL_ADD, v->kick, &ev) < 0)
			return die("epoll");
	}
	{
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = MAXQ };

		if (epoll_ctl(ep, EPOLL_CTL_ADD, done_efd, &ev) < 0)
			return die("epoll");
	}
	t0 = now_ns();
	for (int q = 0; q < nq; q++)
		pthread_create(&vqs[q].thread, NULL, vcpu, (void *)(intptr_t)q);

	if (poll_ns) {
		/* A polling engine is an iothread of its own, named as QEMU
		 * names them ("IO <id>", debug-threads=on). */
		pthread_t io;

		pthread_create(&io, NULL, engine, "IO iothread0");
		pthread_join(io, NULL);
	} else
		engine(NULL);
	t1 = now_ns();
	if (failed) {
		stop = 1;
		fprintf(stderr, "vm_load: %s failed\n", name);
		return 1;
	}
	for (int q = 0; q < nq; q++) {
		total += vqs[q].done;
		kicks += vqs[q].kicks;
	}
	printf("vm_load: %s requests=%ld seconds=%.3f iops=%.0f kicks=%llu", name, total, (t1 - t0) / 1e9,
	       total / ((t1 - t0) / 1e9), (unsigned long long)kicks);
	for (int q = 0; q < nq; q++)
		printf(" q%d=%ld", q, vqs[q].done);
	printf("\n");
	fflush(stdout);
	if (logv) {
		FILE *f = fopen(logpath, "w");

		if (!f)
			return die(logpath);
		for (int q = 0; q < nq; q++)
			for (long i = 0; i < ios_per_q; i++) {
				struct logent *l = &logv[q * ios_per_q + i];

				fprintf(f, "%d %ld %llu %llu %llu %llu %llu %llu\n", q, i, (unsigned long long)l->pos,
					(unsigned long long)l->avail_ns, (unsigned long long)l->pop_ns,
					(unsigned long long)l->read_ns, (unsigned long long)l->push_ns,
					(unsigned long long)l->signal_ns);
			}
		if (fclose(f))
			return die(logpath);
	}
	return 0;
}

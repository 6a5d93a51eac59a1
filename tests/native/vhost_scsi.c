/* A VM process whose SCSI disk the kernel's vhost-scsi serves, as QEMU's
 * -device vhost-scsi-pci: the process hands /dev/vhost-scsi its memory and
 * its request queue's split virtio ring, a kick and a call eventfd, and the
 * LIO target's WWPN (VHOST_SCSI_SET_ENDPOINT); from then on the kernel's
 * vhost worker pops the ring, hands each SCSI command to LIO and its
 * backstore, and pushes the response, with no thread of this process in
 * the data path. The process acts as the guest's virtio-scsi driver: one
 * thread ("CPU 0/KVM", beside the main thread, named as QEMU's process)
 * keeps QD commands available, kicks the queue by
 * writing its eventfd (as KVM's ioeventfd does for a guest's notify
 * write), and reaps the used ring when the call eventfd fires.
 *
 * Arguments, QEMU-style (only these are read):
 *   -name guest=NAME,...  -device vhost-scsi-pci,wwpn=WWPN[,id=ID][,...]
 * Environment:
 *   IOSPAN_VHOST_IOS    commands to complete, then exit (default 1000)
 *   IOSPAN_VHOST_QD     commands in flight (default 8, at most 64)
 *   IOSPAN_VHOST_OP     read or write (default read)
 *   IOSPAN_VHOST_LUN    the LUN (default 0)
 *   IOSPAN_VHOST_TPGT   the target portal group (default 1)
 *   IOSPAN_VHOST_DELAY_MS  wait this long after the endpoint is set
 *                       (default 0), as a guest's boot would
 *   IOSPAN_VHOST_LIMIT_S  give up after this long (default 60), saying
 *                       where the queue stood: a hung device never hangs
 *                       the caller
 *   IOSPAN_VHOST_WORKER_CPU  the CPU the kernel's worker is made on (Linux
 *                       6.4 on, where it is a thread of this process and
 *                       takes the affinity of the thread that makes it);
 *                       this process's own threads keep theirs
 * Commands are 4 KiB at distinct, never adjacent 4 KiB-aligned offsets
 * chosen at random within the LUN's capacity (READ CAPACITY(10) first;
 * it must hold 4 x IOS chunks). At exit it prints:
 * "vhost_scsi: NAME requests=N errors=E commands=M kicks=K calls=C block=B"
 * (M: every command the device answered, READ CAPACITY's included). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <linux/vhost.h>
#include <linux/virtio_ring.h>
#include <linux/virtio_scsi.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#define NUM   256 /* ring entries */
#define NQ    3	  /* control, event, request queue */
#define REQ_Q 2
#define MAXQD 64
#define XFER  4096
#define MEM   (8u << 20) /* the guest's memory */

struct slot {
	struct virtio_scsi_cmd_req req;
	struct virtio_scsi_cmd_resp resp;
	uint8_t data[XFER] __attribute__((aligned(4096)));
};

struct ring {
	struct vring_desc *desc;
	struct vring_avail *avail;
	struct vring_used *used;
	uint16_t last_used;
	int kick, call;
};

static uint8_t *mem;
static size_t mem_used;
static struct ring rings[NQ];
static struct slot *slots;
static int vhost, lun, tpgt, qd = 8, writing;
static uint64_t kicks, calls, answered; /* answered: every command, READ CAPACITY's too */

static int die(const char *what)
{
	fprintf(stderr, "vhost_scsi: %s: %s\n", what, errno ? strerror(errno) : "failed");
	exit(1);
}

/* Guest memory is mapped at guest-physical == host-virtual addresses:
 * the ring's addresses need no translation on this side. */
static void *guest_alloc(size_t len, size_t align)
{
	void *p;

	mem_used = (mem_used + align - 1) & ~(align - 1);
	if (mem_used + len > MEM) {
		errno = ENOMEM;
		die("guest memory");
	}
	p = mem + mem_used;
	mem_used += len;
	return p;
}

static long env_long(const char *name, long dflt)
{
	const char *v = getenv(name);

	return v && *v ? strtol(v, NULL, 0) : dflt;
}

static void set_ring(int i)
{
	struct ring *r = &rings[i];
	struct vhost_vring_state num = { .index = i, .num = NUM }, base = { .index = i, .num = 0 };
	struct vhost_vring_addr addr = { .index = i };
	struct vhost_vring_file kick = { .index = i }, call = { .index = i };

	r->desc = guest_alloc(sizeof(struct vring_desc) * NUM, 16);
	r->avail = guest_alloc(sizeof(struct vring_avail) + 2 * NUM + 2, 2);
	r->used = guest_alloc(sizeof(struct vring_used) + sizeof(struct vring_used_elem) * NUM + 2,
			      4);
	r->kick = kick.fd = eventfd(0, EFD_CLOEXEC);
	r->call = call.fd = eventfd(0, EFD_CLOEXEC);
	addr.desc_user_addr = (uint64_t)(uintptr_t)r->desc;
	addr.avail_user_addr = (uint64_t)(uintptr_t)r->avail;
	addr.used_user_addr = (uint64_t)(uintptr_t)r->used;
	if (ioctl(vhost, VHOST_SET_VRING_NUM, &num) || ioctl(vhost, VHOST_SET_VRING_BASE, &base) ||
	    ioctl(vhost, VHOST_SET_VRING_ADDR, &addr) ||
	    ioctl(vhost, VHOST_SET_VRING_KICK, &kick) || ioctl(vhost, VHOST_SET_VRING_CALL, &call))
		die("setting a vring");
}

/* Owning the device makes its worker, on IOSPAN_VHOST_WORKER_CPU if set:
 * this thread moves there for the ioctl and back after. */
static void set_owner(void)
{
	long cpu = env_long("IOSPAN_VHOST_WORKER_CPU", -1);
	cpu_set_t mine, worker;

	if (cpu >= 0) {
		CPU_ZERO(&worker);
		CPU_SET(cpu, &worker);
		if (sched_getaffinity(0, sizeof(mine), &mine) ||
		    sched_setaffinity(0, sizeof(worker), &worker))
			die("IOSPAN_VHOST_WORKER_CPU");
	}
	if (ioctl(vhost, VHOST_SET_OWNER))
		die("VHOST_SET_OWNER");
	if (cpu >= 0 && sched_setaffinity(0, sizeof(mine), &mine))
		die("restoring the main thread's CPUs");
}

static void set_device(const char wwpn[224])
{
	struct vhost_memory *m = calloc(1, sizeof(*m) + sizeof(struct vhost_memory_region));
	struct vhost_scsi_target t = { .abi_version = VHOST_SCSI_ABI_VERSION, .vhost_tpgt = tpgt };
	uint64_t features, wanted = (1ULL << 32) | (1ULL << 27); /* VERSION_1, ANY_LAYOUT */
	int abi, i;

	vhost = open("/dev/vhost-scsi", O_RDWR);
	if (vhost < 0)
		die("/dev/vhost-scsi");
	set_owner();
	if (ioctl(vhost, VHOST_GET_FEATURES, &features))
		die("VHOST_GET_FEATURES");
	features &= wanted;
	if (ioctl(vhost, VHOST_SET_FEATURES, &features))
		die("VHOST_SET_FEATURES");
	m->nregions = 1;
	m->regions[0].guest_phys_addr = (uint64_t)(uintptr_t)mem;
	m->regions[0].userspace_addr = (uint64_t)(uintptr_t)mem;
	m->regions[0].memory_size = MEM;
	if (ioctl(vhost, VHOST_SET_MEM_TABLE, m))
		die("VHOST_SET_MEM_TABLE");
	free(m);
	for (i = 0; i < NQ; i++)
		set_ring(i);
	if (ioctl(vhost, VHOST_SCSI_GET_ABI_VERSION, &abi) || abi != VHOST_SCSI_ABI_VERSION) {
		fprintf(stderr, "vhost_scsi: vhost-scsi ABI %d, this driver speaks %d\n", abi,
			VHOST_SCSI_ABI_VERSION);
		exit(1);
	}
	memcpy(t.vhost_wwpn, wwpn, sizeof(t.vhost_wwpn));
	if (ioctl(vhost, VHOST_SCSI_SET_ENDPOINT, &t))
		die("VHOST_SCSI_SET_ENDPOINT (is the WWPN's tpgt_N enabled with a nexus?)");
}

static void put_be32(uint8_t *p, uint32_t v)
{
	p[0] = v >> 24;
	p[1] = v >> 16;
	p[2] = v >> 8;
	p[3] = v;
}

static uint32_t get_be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* One command in slot `i`: header out; for a read, response and data in,
 * for a write, data out and response in. */
static void post(int i, const uint8_t *cdb, int data_out, uint32_t data_len)
{
	struct ring *r = &rings[REQ_Q];
	struct slot *s = &slots[i];
	struct vring_desc *d = &r->desc[3 * i];
	uint16_t idx = r->avail->idx;

	memset(&s->req, 0, sizeof(s->req));
	memset(&s->resp, 0, sizeof(s->resp));
	s->req.lun[0] = 1;
	s->req.lun[1] = tpgt; /* vhost-scsi finds the target by its tpgt */
	s->req.lun[2] = 0x40 | (lun >> 8);
	s->req.lun[3] = lun & 0xff;
	s->req.tag = i;
	s->req.task_attr = VIRTIO_SCSI_S_SIMPLE;
	memcpy(s->req.cdb, cdb, 16);
	d[0] = (struct vring_desc){ (uintptr_t)&s->req, sizeof(s->req), VRING_DESC_F_NEXT,
				    3 * i + 1 };
	if (data_out) {
		d[1] = (struct vring_desc){ (uintptr_t)s->data, data_len, VRING_DESC_F_NEXT,
					    3 * i + 2 };
		d[2] = (struct vring_desc){ (uintptr_t)&s->resp, sizeof(s->resp),
					    VRING_DESC_F_WRITE, 0 };
	} else {
		d[1] = (struct vring_desc){ (uintptr_t)&s->resp, sizeof(s->resp),
					    VRING_DESC_F_WRITE | VRING_DESC_F_NEXT, 3 * i + 2 };
		d[2] = (struct vring_desc){ (uintptr_t)s->data, data_len, VRING_DESC_F_WRITE, 0 };
	}
	r->avail->ring[idx % NUM] = 3 * i;
	__atomic_store_n(&r->avail->idx, (uint16_t)(idx + 1), __ATOMIC_RELEASE);
}

static void kick(void)
{
	uint64_t one = 1;

	if (write(rings[REQ_Q].kick, &one, 8) != 8)
		die("kick");
	kicks++;
}

/* The next used slot, -1 if none is there yet. */
static int reap(void)
{
	struct ring *r = &rings[REQ_Q];
	uint16_t used = __atomic_load_n(&r->used->idx, __ATOMIC_ACQUIRE);
	int id;

	if (r->last_used == used)
		return -1;
	id = r->used->ring[r->last_used % NUM].id / 3;
	r->last_used++;
	answered++;
	return id;
}

/* Sleeps until the device signals the queue (its interrupt). */
static void wait_call(void)
{
	uint64_t n;

	if (read(rings[REQ_Q].call, &n, 8) != 8)
		die("waiting for the call eventfd");
	calls++;
}

static void give_up(int sig)
{
	struct ring *r = &rings[REQ_Q];

	(void)sig;
	fprintf(stderr,
		"vhost_scsi: no completion in time: avail %u, used %u, reaped %u, "
		"kicks %llu, "
		"calls %llu\n",
		r->avail->idx, r->used->idx, r->last_used, (unsigned long long)kicks,
		(unsigned long long)calls);
	_exit(3);
}

static int ok(int i)
{
	struct slot *s = &slots[i];

	if (s->resp.response == VIRTIO_SCSI_S_OK && s->resp.status == 0)
		return 1;
	fprintf(stderr, "vhost_scsi: tag %d: response %u status 0x%x sense %02x/%02x/%02x\n", i,
		s->resp.response, s->resp.status, s->resp.sense[2] & 0xf, s->resp.sense[12],
		s->resp.sense[13]);
	return 0;
}

static int unit_attention(int i)
{
	return slots[i].resp.status == 2 && (slots[i].resp.sense[2] & 0xf) == 6;
}

/* READ CAPACITY(10): the LUN's block size and block count. A new nexus's
 * first command may get a unit attention (the LUNs changed): retried, as
 * a guest's SCSI layer does. */
static void capacity(uint32_t *block, uint64_t *blocks)
{
	uint8_t cdb[16] = { 0x25 };
	int i, tries = 0;

	do {
		post(0, cdb, 0, 8);
		kick();
		while ((i = reap()) < 0)
			wait_call();
	} while (unit_attention(i) && ++tries < 4);
	if (!ok(i))
		die("READ CAPACITY");
	*blocks = (uint64_t)get_be32(slots[0].data) + 1;
	*block = get_be32(slots[0].data + 4);
}

/* A 4 KiB chunk not used before and never next to one used: the
 * backstore's requests are then the commands, one each (adjacent ones may
 * be merged on the way to the disk). */
static uint64_t next_lba(uint64_t chunks, uint32_t per, uint8_t *seen)
{
	uint64_t c;

	do
		c = (((uint64_t)rand() << 31 ^ rand()) % (chunks / 2)) * 2;
	while (seen[c / 8] & (1 << (c % 8)));
	seen[c / 8] |= 1 << (c % 8);
	return c * per;
}

static void issue(int i, uint64_t lba, uint32_t per)
{
	uint8_t cdb[16] = { writing ? 0x2a : 0x28 };

	put_be32(cdb + 2, (uint32_t)lba);
	cdb[7] = per >> 8;
	cdb[8] = per & 0xff;
	if (writing)
		memset(slots[i].data, (int)(lba & 0xff), XFER);
	post(i, cdb, writing, XFER);
}

/* The value of `key` in the argument after `flag` that starts with
 * `prefix`, into buf (empty if none). */
static void arg_value(int argc, char **argv, const char *flag, const char *prefix, const char *key,
		      char *buf, size_t len)
{
	int i;

	buf[0] = 0;

	for (i = 1; i + 1 < argc; i++) {
		const char *v = argv[i + 1], *k;

		if (strcmp(argv[i], flag) || strncmp(v, prefix, strlen(prefix)))
			continue;
		k = strstr(v, key);
		if (!k)
			continue;
		snprintf(buf, len, "%.*s", (int)strcspn(k + strlen(key), ","), k + strlen(key));
		return;
	}
}

/* What the guest's driver did. */
struct run {
	long ios, done, errors;
	uint32_t block;
	int rc;
};

/* The guest's driver, in a vCPU thread as QEMU's ("CPU 0/KVM"): QEMU's
 * main thread keeps the process's name. */
static void *vcpu(void *arg)
{
	struct run *r = arg;
	long made = 0;
	uint64_t blocks, chunks;
	uint32_t per;
	uint8_t *seen;
	int i;

	prctl(PR_SET_NAME, "CPU 0/KVM");
	capacity(&r->block, &blocks);
	if (!r->block || XFER % r->block || blocks * r->block < (uint64_t)XFER * 4 * r->ios) {
		fprintf(stderr,
			"vhost_scsi: LUN %d: %llu blocks of %u: too small for %ld commands\n", lun,
			(unsigned long long)blocks, r->block, r->ios);
		r->rc = 1;
		return NULL;
	}
	per = XFER / r->block;
	chunks = blocks / per;
	seen = calloc(chunks / 8 + 1, 1);
	srand(getpid());
	for (i = 0; i < qd && made < r->ios; i++, made++)
		issue(i, next_lba(chunks, per, seen), per);
	kick();
	while (r->done < r->ios) {
		int more = 0;

		while (r->done < r->ios && (i = reap()) >= 0) {
			r->done++;
			r->errors += !ok(i);
			if (made < r->ios) {
				issue(i, next_lba(chunks, per, seen), per);
				made++;
				more = 1;
			}
		}
		if (more)
			kick();
		else if (r->done < r->ios)
			wait_call();
	}
	r->rc = r->errors ? 1 : 0;
	return NULL;
}

int main(int argc, char **argv)
{
	char name[64], wwpn[224], w[256];
	struct run r = { .ios = env_long("IOSPAN_VHOST_IOS", 1000) };
	const char *op = getenv("IOSPAN_VHOST_OP");
	pthread_t t;

	arg_value(argc, argv, "-device", "vhost-scsi-pci,", "wwpn=", w, sizeof(w));
	arg_value(argc, argv, "-name", "guest=", "guest=", name, sizeof(name));
	if (!w[0]) {
		fprintf(stderr, "usage: %s -name guest=NAME -device vhost-scsi-pci,wwpn=WWPN\n",
			argv[0]);
		return 2;
	}
	if (strlen(w) >= sizeof(wwpn)) {
		fprintf(stderr, "vhost_scsi: wwpn=%s: longer than vhost-scsi's %zu bytes\n", w,
			sizeof(wwpn) - 1);
		return 2;
	}
	snprintf(wwpn, sizeof(wwpn), "%s", w);
	qd = env_long("IOSPAN_VHOST_QD", 8);
	if (qd < 1 || qd > MAXQD)
		qd = 8;
	lun = env_long("IOSPAN_VHOST_LUN", 0);
	writing = op && !strcmp(op, "write");
	mem = mmap(NULL, MEM, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
		   -1, 0);
	if (mem == MAP_FAILED)
		die("mmap");
	slots = guest_alloc(sizeof(struct slot) * MAXQD, 4096);
	tpgt = env_long("IOSPAN_VHOST_TPGT", 1);
	set_device(wwpn);
	usleep(env_long("IOSPAN_VHOST_DELAY_MS", 0) * 1000);
	signal(SIGALRM, give_up);
	alarm(env_long("IOSPAN_VHOST_LIMIT_S", 60));
	if (pthread_create(&t, NULL, vcpu, &r) || pthread_join(t, NULL))
		die("the vCPU thread");
	printf("vhost_scsi: %s requests=%ld errors=%ld commands=%llu kicks=%llu calls=%llu "
	       "block=%u\n",
	       name, r.done, r.errors, (unsigned long long)answered, (unsigned long long)kicks,
	       (unsigned long long)calls, r.block);
	return r.rc;
}

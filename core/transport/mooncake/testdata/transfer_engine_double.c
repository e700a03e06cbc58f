/*
 * A test double of Mooncake TransferEngine's C API (transfer_engine_c.h),
 * for the tests and benchmarks of ecmooncake's `mooncake` transport.
 *
 * It keeps the contract the transport relies on and moves real bytes between
 * engines, in one process or across processes:
 *   - every engine serves its registered memory on a TCP listener; in
 *     P2PHANDSHAKE mode its segment name is "host:port" of that listener, in
 *     HTTP metadata mode it is local_server_name, published as
 *     mooncake/rpc_meta/<name> on the metadata server (GET/PUT/DELETE
 *     /metadata?key=K, the protocol of Mooncake's HTTP plugin);
 *   - registration bookkeeping: zero length and overlaps are refused;
 *   - the two return-code conventions: submitTransfer, getTransferStatus and
 *     freeBatchID return 0 or a positive status, the other int functions 0 or
 *     a negative error;
 *   - writes are asynchronous (one worker thread per engine) and bounds
 *     checked by the receiving engine: a write outside its registered memory,
 *     or aimed at an older incarnation of it, ends FAILED;
 *   - freeBatchID answers 4 (busy) while a task of the batch is unfinished;
 *   - an unknown metadata scheme aborts the process, as Mooncake does.
 *
 * Extra functions, prefixed mcd_, inject faults and expose counters.
 * Compile: cc -shared -fPIC -O2 -pthread -o libtransfer_engine.so this.c
 * With -DMCD_OMIT_FREEBATCHID it lacks freeBatchID (a library missing a
 * symbol). Only WRITE is implemented; READ is refused as invalid.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define STATUS_WAITING 0
#define STATUS_PENDING 1
#define STATUS_INVALID 2
#define STATUS_CANCELED 3
#define STATUS_COMPLETED 4
#define STATUS_TIMEOUT 5
#define STATUS_FAILED 6

/* Positive convention (Status codes). */
#define S_INVALID 1
#define S_TOO_MANY 2
#define S_NOT_REGISTERED 3
#define S_BUSY 4
#define S_NO_TRANSPORT 8
/* Negative convention (error.h). */
#define E_INVALID (-1)
#define E_NOT_REGISTERED (-3)
#define E_OVERLAP (-7)
#define E_METADATA (-200)

#define MAX_REGS 64
#define MAX_SEGS 256
#define MAX_CONNS 256
#define NAME_LEN 256
#define MAGIC 0x4d434442u /* "MCDB" */

struct transfer_request {
    int opcode;
    void *source;
    int32_t target_id;
    uint32_t file_id;
    uint64_t target_offset;
    uint64_t length;
};

struct transfer_status {
    int status;
    uint64_t transferred_bytes;
};

typedef struct buffer_entry {
    void *addr;
    size_t length;
} buffer_entry_t;

struct mcd_stats {
    int64_t engines_live;
    int64_t batches_live;
    int64_t batches_allocated;
    int64_t batches_freed;
    int64_t busy_frees;
    int64_t bad_batch_ids;
    int64_t regs_live;
    int64_t register_calls;
    int64_t unregister_calls;
    int64_t unregister_unknown;
    int64_t open_calls;
    int64_t open_nocache_calls;
    int64_t tasks_submitted;
    int64_t tasks_failed;
    int64_t bytes_landed;
    int64_t writes_refused;
};

typedef struct reg {
    uintptr_t addr;
    size_t len;
} reg_t;

struct engine;
struct batch;

typedef struct task {
    struct batch *b;
    void *src;
    int32_t seg;
    uint64_t off, len;
    int status;
    uint64_t done;
    struct task *next; /* queue link */
} task_t;

typedef struct batch {
    uint32_t magic;
    struct engine *e;
    size_t cap, n;
    task_t *tasks;
    struct batch *next; /* live list */
} batch_t;

typedef struct seg {
    char name[NAME_LEN];
    char host[128];
    int port;
    int fd;
    uint64_t incarnation;
    char proto[16];
} seg_t;

typedef struct engine {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char name[NAME_LEN];
    char host[128];
    int port;
    int lfd;
    uint64_t incarnation;
    char proto[16];
    int http;
    char mhost[128];
    int mport;
    char mpath[NAME_LEN];
    reg_t regs[MAX_REGS];
    int nregs;
    seg_t segs[MAX_SEGS];
    int nsegs;
    task_t *qhead, *qtail;
    int stopping;
    int killed;
    int delay_us;
    int held; /* incoming writes wait, unread, until it is cleared */
    pthread_t acceptor, worker;
    int conns[MAX_CONNS];
    pthread_t conn_threads[MAX_CONNS];
    int nconns;
    int graveyard[MAX_SEGS]; /* fds replaced by a reopen, closed at destroy */
    int ngrave;
    struct engine *next;
} engine_t;

/* Wire format between engines. */
enum { OP_DESCRIBE = 1, OP_WRITE = 2 };
struct wire_req {
    uint32_t magic, op;
    uint64_t addr, len, incarnation;
    char proto[16];
};
struct wire_desc {
    uint32_t status, nregs;
    uint64_t incarnation;
    char proto[16];
};
struct wire_ack {
    uint32_t status, pad;
    uint64_t n;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static engine_t *g_engines;
static batch_t *g_batches;
static struct mcd_stats g_stats;
static int g_fail_next;

/* ---- helpers -------------------------------------------------------- */

/* move_all sends (or, with sending 0, receives) all n bytes at p. */
static int move_all(int fd, char *c, size_t n, int sending) {
    while (n > 0) {
        ssize_t k = sending ? send(fd, c, n, MSG_NOSIGNAL) : recv(fd, c, n, MSG_WAITALL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static int write_all(int fd, const void *p, size_t n) { return move_all(fd, (char *)p, n, 1); }
static int read_all(int fd, void *p, size_t n) { return move_all(fd, p, n, 0); }

/* count adds n to one of g_stats' counters, under g_mu. */
static void count(int64_t *counter, int64_t n) {
    pthread_mutex_lock(&g_mu);
    *counter += n;
    pthread_mutex_unlock(&g_mu);
}

static uint64_t random64(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40) ^ (uintptr_t)&ts;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x ? x : 1;
}

static int dial(const char *host, int port, int timeout_ms) {
    char ports[16];
    snprintf(ports, sizeof ports, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, ports, &hints, &res) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, 0);
        if (fd < 0) continue;
        struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

/* Splits "host:port" or "[v6]:port"; a missing port leaves *port alone. */
static void split_host_port(const char *s, char *host, size_t hlen, int *port) {
    const char *colon = strrchr(s, ':');
    if (s[0] == '[') {
        const char *end = strchr(s, ']');
        size_t n = end ? (size_t)(end - s - 1) : strlen(s + 1);
        snprintf(host, hlen, "%.*s", (int)n, s + 1);
        if (end && end[1] == ':') *port = atoi(end + 2);
        return;
    }
    if (colon && strchr(s, ':') == colon) {
        snprintf(host, hlen, "%.*s", (int)(colon - s), s);
        *port = atoi(colon + 1);
        return;
    }
    snprintf(host, hlen, "%s", s);
}

/* ---- HTTP metadata client (what Mooncake's HTTP plugin sends) -------- */

static void url_escape(const char *in, char *out, size_t olen) {
    static const char hex[] = "0123456789ABCDEF";
    size_t j = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p && j + 4 < olen; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '-' ||
            *p == '.' || *p == '_' || *p == '~') {
            out[j++] = (char)*p;
        } else {
            out[j++] = '%';
            out[j++] = hex[*p >> 4];
            out[j++] = hex[*p & 15];
        }
    }
    out[j] = 0;
}

/* Returns the HTTP status (or -1) and copies the body into body. */
static int http_call(engine_t *e, const char *method, const char *key, const char *payload, char *body, size_t blen) {
    char esc[3 * NAME_LEN + 64], req[8192];
    url_escape(key, esc, sizeof esc);
    int fd = dial(e->mhost, e->mport, 3000);
    if (fd < 0) return -1;
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    size_t plen = payload ? strlen(payload) : 0;
    /* As Mooncake's plugin: a bearer token from the environment when set. */
    char auth[512] = "";
    const char *token = getenv("MC_METADATA_HTTP_TOKEN");
    if (token && *token) snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", token);
    int n = snprintf(req, sizeof req,
                     "%s %s?key=%s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n%s%s"
                     "Content-Length: %zu\r\n\r\n%s",
                     method, e->mpath, esc, e->mhost, e->mport, auth, payload ? "Content-Type: application/json\r\n" : "", plen,
                     payload ? payload : "");
    if (n < 0 || (size_t)n >= sizeof req || write_all(fd, req, (size_t)n) != 0) {
        close(fd);
        return -1;
    }
    char resp[16384];
    size_t got = 0;
    for (;;) {
        ssize_t k = recv(fd, resp + got, sizeof resp - 1 - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
        if (got == sizeof resp - 1) break;
    }
    close(fd);
    resp[got] = 0;
    int status = -1;
    if (sscanf(resp, "HTTP/1.%*d %d", &status) != 1) return -1;
    if (body && blen) {
        const char *b = strstr(resp, "\r\n\r\n");
        snprintf(body, blen, "%s", b ? b + 4 : "");
    }
    return status;
}

/* Finds "field": value in a flat JSON object (the double's own output). */
static int json_field(const char *json, const char *field, char *out, size_t olen) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", field);
    const char *p = strstr(json, pat);
    if (!p) return -1;
    p = strchr(p + strlen(pat), ':');
    if (!p) return -1;
    p++;
    while (*p == ' ') p++;
    size_t j = 0;
    if (*p == '"') {
        p++;
        while (*p && *p != '"' && j + 1 < olen) out[j++] = *p++;
    } else {
        while (*p && *p != ',' && *p != '}' && *p != ' ' && j + 1 < olen) out[j++] = *p++;
    }
    out[j] = 0;
    return 0;
}

/* ---- serving side ----------------------------------------------------- */

typedef struct conn_arg {
    engine_t *e;
    int fd;
} conn_arg_t;

static int inside_regs(engine_t *e, uint64_t addr, uint64_t len) {
    for (int i = 0; i < e->nregs; i++) {
        uint64_t a = e->regs[i].addr, n = e->regs[i].len;
        if (addr >= a && len <= n && addr - a <= n - len) return 1;
    }
    return 0;
}

static void *serve_conn(void *p) {
    conn_arg_t *ca = p;
    engine_t *e = ca->e;
    int fd = ca->fd;
    free(ca);
    static char discard[1 << 16];
    struct wire_req rq;
    while (read_all(fd, &rq, sizeof rq) == 0 && rq.magic == MAGIC) {
        if (rq.op == OP_DESCRIBE) {
            pthread_mutex_lock(&e->mu);
            struct wire_desc d = {0, (uint32_t)e->nregs, e->incarnation, {0}};
            memcpy(d.proto, e->proto, sizeof d.proto);
            reg_t regs[MAX_REGS];
            memcpy(regs, e->regs, sizeof regs);
            pthread_mutex_unlock(&e->mu);
            if (write_all(fd, &d, sizeof d) != 0) break;
            int bad = 0;
            for (uint32_t i = 0; i < d.nregs && !bad; i++) {
                uint64_t pair[2] = {regs[i].addr, regs[i].len};
                bad = write_all(fd, pair, sizeof pair);
            }
            if (bad) break;
            continue;
        }
        if (rq.op != OP_WRITE) break;
        pthread_mutex_lock(&e->mu);
        int delay = e->delay_us;
        uint32_t status = 0;
        if (strncmp(rq.proto, e->proto, sizeof rq.proto) != 0)
            status = S_NO_TRANSPORT;
        else if (rq.incarnation != e->incarnation)
            status = S_INVALID;
        else if (!inside_regs(e, rq.addr, rq.len))
            status = S_NOT_REGISTERED;
        pthread_mutex_unlock(&e->mu);
        if (delay > 0) usleep((useconds_t)delay);
        for (;;) {
            pthread_mutex_lock(&e->mu);
            int wait = e->held && !e->killed && !e->stopping;
            pthread_mutex_unlock(&e->mu);
            if (!wait) break;
            usleep(1000);
        }
        int broken = 0;
        if (status == 0) {
            broken = read_all(fd, (void *)(uintptr_t)rq.addr, rq.len);
        } else {
            for (uint64_t left = rq.len; left > 0 && !broken;) {
                size_t k = left < sizeof discard ? (size_t)left : sizeof discard;
                broken = read_all(fd, discard, k);
                left -= k;
            }
        }
        if (broken) break;
        pthread_mutex_lock(&g_mu);
        if (status == 0)
            g_stats.bytes_landed += (int64_t)rq.len;
        else
            g_stats.writes_refused++;
        pthread_mutex_unlock(&g_mu);
        struct wire_ack ack = {status, 0, status == 0 ? rq.len : 0};
        if (write_all(fd, &ack, sizeof ack) != 0) break;
    }
    shutdown(fd, SHUT_RDWR);
    return NULL;
}

static void *accept_loop(void *p) {
    engine_t *e = p;
    for (;;) {
        int fd = accept(e->lfd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_mutex_lock(&e->mu);
        if (e->stopping || e->killed || e->nconns == MAX_CONNS) {
            pthread_mutex_unlock(&e->mu);
            close(fd);
            continue;
        }
        conn_arg_t *ca = malloc(sizeof *ca);
        ca->e = e;
        ca->fd = fd;
        e->conns[e->nconns] = fd;
        pthread_create(&e->conn_threads[e->nconns], NULL, serve_conn, ca);
        e->nconns++;
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}

/* ---- initiating side -------------------------------------------------- */

static void finish_task(task_t *t, int status, uint64_t done) {
    engine_t *e = t->b->e;
    pthread_mutex_lock(&e->mu);
    t->status = status;
    t->done = done;
    pthread_mutex_unlock(&e->mu);
    if (status != STATUS_COMPLETED) {
        count(&g_stats.tasks_failed, 1);
    }
}

static void run_task(engine_t *e, task_t *t) {
    pthread_mutex_lock(&g_mu);
    int fail = g_fail_next > 0;
    if (fail) g_fail_next--;
    pthread_mutex_unlock(&g_mu);
    if (fail) {
        finish_task(t, STATUS_FAILED, 0);
        return;
    }
    pthread_mutex_lock(&e->mu);
    seg_t *s = &e->segs[t->seg - 1];
    int fd = s->fd;
    struct wire_req rq = {MAGIC, OP_WRITE, t->off, t->len, s->incarnation, {0}};
    memcpy(rq.proto, e->proto, sizeof rq.proto);
    t->status = STATUS_PENDING;
    pthread_mutex_unlock(&e->mu);
    struct wire_ack ack;
    if (fd < 0 || write_all(fd, &rq, sizeof rq) != 0 || write_all(fd, t->src, t->len) != 0 ||
        read_all(fd, &ack, sizeof ack) != 0) {
        /* The connection is gone: every later task to this segment fails
         * too, until openSegmentNoCache looks the peer up again. */
        pthread_mutex_lock(&e->mu);
        if (s->fd == fd && fd >= 0) {
            shutdown(fd, SHUT_RDWR);
            e->graveyard[e->ngrave++ % MAX_SEGS] = fd;
            s->fd = -1;
        }
        pthread_mutex_unlock(&e->mu);
        finish_task(t, STATUS_FAILED, 0);
        return;
    }
    finish_task(t, ack.status == 0 ? STATUS_COMPLETED : STATUS_FAILED, ack.n);
}

static void *worker_loop(void *p) {
    engine_t *e = p;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->qhead && !e->stopping) pthread_cond_wait(&e->cv, &e->mu);
        if (!e->qhead) break;
        task_t *t = e->qhead;
        e->qhead = t->next;
        if (!e->qhead) e->qtail = NULL;
        pthread_mutex_unlock(&e->mu);
        run_task(e, t);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Connects to a segment and reads its descriptor. */
static int describe(engine_t *e, seg_t *s) {
    char host[128];
    int port = 0;
    if (e->http) {
        char key[NAME_LEN + 32], body[4096], portstr[16];
        snprintf(key, sizeof key, "mooncake/rpc_meta/%s", s->name);
        if (http_call(e, "GET", key, NULL, body, sizeof body) != 200) return -1;
        if (json_field(body, "ip_or_host_name", host, sizeof host) || json_field(body, "rpc_port", portstr, sizeof portstr))
            return -1;
        port = atoi(portstr);
    } else {
        split_host_port(s->name, host, sizeof host, &port);
    }
    if (port <= 0) return -1;
    int fd = dial(host, port, 3000);
    if (fd < 0) return -1;
    struct wire_req rq = {MAGIC, OP_DESCRIBE, 0, 0, 0, {0}};
    struct wire_desc d;
    if (write_all(fd, &rq, sizeof rq) != 0 || read_all(fd, &d, sizeof d) != 0) {
        close(fd);
        return -1;
    }
    for (uint32_t i = 0; i < d.nregs; i++) {
        uint64_t pair[2];
        if (read_all(fd, pair, sizeof pair) != 0) {
            close(fd);
            return -1;
        }
    }
    snprintf(s->host, sizeof s->host, "%s", host);
    s->port = port;
    s->fd = fd;
    s->incarnation = d.incarnation;
    memcpy(s->proto, d.proto, sizeof s->proto);
    return 0;
}

/* ---- the C API ---------------------------------------------------------- */

void *createTransferEngine(const char *metadata, const char *local_server_name, const char *ip_or_host_name,
                           uint64_t rpc_port, int auto_discover) {
    (void)rpc_port;
    (void)auto_discover;
    if (!metadata || !local_server_name) return NULL;
    engine_t *e = calloc(1, sizeof *e);
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->incarnation = random64();
    int dummy = 0;
    if (strcmp(metadata, "P2PHANDSHAKE") == 0) {
        split_host_port(local_server_name, e->host, sizeof e->host, &dummy);
    } else if (strncmp(metadata, "http://", 7) == 0) {
        e->http = 1;
        const char *hp = metadata + 7, *slash = strchr(hp, '/');
        char hostport[256];
        snprintf(hostport, sizeof hostport, "%.*s", slash ? (int)(slash - hp) : (int)strlen(hp), hp);
        e->mport = 80;
        split_host_port(hostport, e->mhost, sizeof e->mhost, &e->mport);
        snprintf(e->mpath, sizeof e->mpath, "%s", slash ? slash : "/metadata");
        snprintf(e->host, sizeof e->host, "%s", ip_or_host_name && *ip_or_host_name ? ip_or_host_name : "127.0.0.1");
    } else {
        fprintf(stderr, "transfer_engine_double: unable to find metadata storage plugin for %s\n", metadata);
        abort();
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(e->host, "0", &hints, &res) != 0) goto fail;
    e->lfd = socket(res->ai_family, SOCK_STREAM, 0);
    if (e->lfd < 0 || bind(e->lfd, res->ai_addr, res->ai_addrlen) != 0 || listen(e->lfd, 64) != 0) {
        freeaddrinfo(res);
        goto fail;
    }
    freeaddrinfo(res);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(e->lfd, (struct sockaddr *)&ss, &sl);
    e->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
    if (e->http) {
        char key[NAME_LEN + 32], val[512];
        snprintf(e->name, sizeof e->name, "%s", local_server_name);
        snprintf(key, sizeof key, "mooncake/rpc_meta/%s", e->name);
        snprintf(val, sizeof val, "{\"ip_or_host_name\": \"%s\", \"rpc_port\": %d}", e->host, e->port);
        if (http_call(e, "PUT", key, val, NULL, 0) != 200) goto fail;
    } else if (strchr(e->host, ':')) {
        snprintf(e->name, sizeof e->name, "[%s]:%d", e->host, e->port);
    } else {
        snprintf(e->name, sizeof e->name, "%s:%d", e->host, e->port);
    }
    pthread_create(&e->acceptor, NULL, accept_loop, e);
    pthread_create(&e->worker, NULL, worker_loop, e);
    pthread_mutex_lock(&g_mu);
    e->next = g_engines;
    g_engines = e;
    g_stats.engines_live++;
    pthread_mutex_unlock(&g_mu);
    return e;
fail:
    if (e->lfd > 0) close(e->lfd);
    free(e);
    return NULL;
}

static void stop_serving(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    e->killed = 1;
    shutdown(e->lfd, SHUT_RDWR);
    for (int i = 0; i < e->nconns; i++) shutdown(e->conns[i], SHUT_RDWR);
    pthread_mutex_unlock(&e->mu);
}

void destroyTransferEngine(void *engine) {
    engine_t *e = engine;
    if (!e) return;
    pthread_mutex_lock(&g_mu);
    for (engine_t **p = &g_engines; *p; p = &(*p)->next) {
        if (*p == e) {
            *p = e->next;
            break;
        }
    }
    g_stats.engines_live--;
    g_stats.regs_live -= e->nregs;
    pthread_mutex_unlock(&g_mu);
    stop_serving(e);
    pthread_join(e->acceptor, NULL);
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->cv);
    for (int i = 0; i < e->nsegs; i++)
        if (e->segs[i].fd >= 0) shutdown(e->segs[i].fd, SHUT_RDWR);
    int n = e->nconns;
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->worker, NULL);
    for (int i = 0; i < n; i++) pthread_join(e->conn_threads[i], NULL);
    for (task_t *t = e->qhead; t; t = t->next) t->status = STATUS_FAILED;
    for (int i = 0; i < n; i++) close(e->conns[i]);
    for (int i = 0; i < e->nsegs; i++)
        if (e->segs[i].fd >= 0) close(e->segs[i].fd);
    for (int i = 0; i < e->ngrave && i < MAX_SEGS; i++) close(e->graveyard[i]);
    close(e->lfd);
    if (e->http) {
        char key[NAME_LEN + 32];
        snprintf(key, sizeof key, "mooncake/rpc_meta/%s", e->name);
        http_call(e, "DELETE", key, NULL, NULL, 0);
    }
    free(e);
}

int getLocalIpAndPort(void *engine, char *buf, size_t len) {
    engine_t *e = engine;
    if (strchr(e->host, ':'))
        snprintf(buf, len, "[%s]:%d", e->host, e->port);
    else
        snprintf(buf, len, "%s:%d", e->host, e->port);
    return 0;
}

void *installTransport(void *engine, const char *proto, void **args) {
    (void)args;
    engine_t *e = engine;
    static const char *known[] = {"rdma", "tcp", "nvlink", "nvlink_intra", "efa", "barex", "hip", NULL};
    for (int i = 0; known[i]; i++) {
        if (strcmp(proto, known[i]) == 0) {
            pthread_mutex_lock(&e->mu);
            if (!e->proto[0]) snprintf(e->proto, sizeof e->proto, "%s", proto);
            pthread_mutex_unlock(&e->mu);
            return e;
        }
    }
    return NULL;
}

static int overlaps(engine_t *e, uintptr_t a, size_t n) {
    for (int i = 0; i < e->nregs; i++)
        if (a < e->regs[i].addr + e->regs[i].len && e->regs[i].addr < a + n) return 1;
    return 0;
}

int registerLocalMemoryBatch(void *engine, buffer_entry_t *list, size_t n, const char *location) {
    (void)location;
    engine_t *e = engine;
    count(&g_stats.register_calls, 1);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->nregs + (int)n > MAX_REGS) rc = E_INVALID;
    for (size_t i = 0; i < n && !rc; i++) {
        uintptr_t a = (uintptr_t)list[i].addr;
        if (list[i].length == 0)
            rc = E_INVALID;
        else if (overlaps(e, a, list[i].length))
            rc = E_OVERLAP;
        for (size_t j = 0; j < i && !rc; j++) {
            uintptr_t b = (uintptr_t)list[j].addr;
            if (a < b + list[j].length && b < a + list[i].length) rc = E_OVERLAP;
        }
    }
    if (!rc) {
        for (size_t i = 0; i < n; i++) e->regs[e->nregs++] = (reg_t){(uintptr_t)list[i].addr, list[i].length};
    }
    pthread_mutex_unlock(&e->mu);
    if (!rc) count(&g_stats.regs_live, (int64_t)n);
    return rc;
}

int registerLocalMemory(void *engine, void *addr, size_t length, const char *location, int remote_accessible) {
    (void)remote_accessible;
    buffer_entry_t b = {addr, length};
    return registerLocalMemoryBatch(engine, &b, 1, location);
}

int unregisterLocalMemoryBatch(void *engine, void **addrs, size_t n) {
    engine_t *e = engine;
    int rc = 0, removed = 0;
    pthread_mutex_lock(&e->mu);
    for (size_t i = 0; i < n; i++) {
        int found = 0;
        for (int j = 0; j < e->nregs; j++) {
            if (e->regs[j].addr == (uintptr_t)addrs[i]) {
                e->regs[j] = e->regs[--e->nregs];
                found = 1;
                removed++;
                break;
            }
        }
        if (!found) rc = E_NOT_REGISTERED;
    }
    int left = e->nregs;
    pthread_mutex_unlock(&e->mu);
    if (e->http && !rc) {
        /* Mooncake publishes the segment's new buffer list: with the
         * metadata server gone, unregistering fails with -200. */
        char key[NAME_LEN + 32], val[64];
        snprintf(key, sizeof key, "mooncake/ram/%s", e->name);
        snprintf(val, sizeof val, "{\"buffers\": %d}", left);
        if (http_call(e, "PUT", key, val, NULL, 0) != 200) rc = E_METADATA;
    }
    pthread_mutex_lock(&g_mu);
    g_stats.unregister_calls++;
    g_stats.regs_live -= removed;
    if (rc) g_stats.unregister_unknown++;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

int unregisterLocalMemory(void *engine, void *addr) { return unregisterLocalMemoryBatch(engine, &addr, 1); }

static int32_t open_segment(engine_t *e, const char *name, int nocache) {
    pthread_mutex_lock(&g_mu);
    if (nocache)
        g_stats.open_nocache_calls++;
    else
        g_stats.open_calls++;
    pthread_mutex_unlock(&g_mu);
    if (!name || !*name || strlen(name) >= NAME_LEN) return E_INVALID;
    pthread_mutex_lock(&e->mu);
    int idx = -1;
    for (int i = 0; i < e->nsegs; i++)
        if (strcmp(e->segs[i].name, name) == 0) idx = i;
    if (idx >= 0 && !nocache) {
        pthread_mutex_unlock(&e->mu);
        return idx + 1;
    }
    if (idx < 0 && e->nsegs == MAX_SEGS) {
        pthread_mutex_unlock(&e->mu);
        return E_INVALID;
    }
    pthread_mutex_unlock(&e->mu);
    seg_t fresh = {{0}, {0}, 0, -1, 0, {0}};
    snprintf(fresh.name, sizeof fresh.name, "%s", name);
    if (describe(e, &fresh) != 0) return nocache ? E_METADATA : E_INVALID;
    pthread_mutex_lock(&e->mu);
    if (idx < 0) {
        for (int i = 0; i < e->nsegs; i++)
            if (strcmp(e->segs[i].name, name) == 0) idx = i;
        if (idx < 0) idx = e->nsegs++;
    } else if (e->segs[idx].fd >= 0) {
        shutdown(e->segs[idx].fd, SHUT_RDWR);
        e->graveyard[e->ngrave++ % MAX_SEGS] = e->segs[idx].fd;
    }
    e->segs[idx] = fresh;
    pthread_mutex_unlock(&e->mu);
    return idx + 1;
}

int32_t openSegment(void *engine, const char *name) { return open_segment(engine, name, 0); }
int32_t openSegmentNoCache(void *engine, const char *name) { return open_segment(engine, name, 1); }

static batch_t *live_batch(uint64_t id) {
    for (batch_t *b = g_batches; b; b = b->next)
        if ((uint64_t)(uintptr_t)b == id && b->magic == MAGIC) return b;
    g_stats.bad_batch_ids++;
    return NULL;
}

uint64_t allocateBatchID(void *engine, size_t cap) {
    batch_t *b = calloc(1, sizeof *b);
    b->magic = MAGIC;
    b->e = engine;
    b->cap = cap;
    b->tasks = calloc(cap ? cap : 1, sizeof(task_t));
    pthread_mutex_lock(&g_mu);
    b->next = g_batches;
    g_batches = b;
    g_stats.batches_live++;
    g_stats.batches_allocated++;
    pthread_mutex_unlock(&g_mu);
    return (uint64_t)(uintptr_t)b;
}

/* engine_batch is batch id if it is live and e's, else NULL. */
static batch_t *engine_batch(engine_t *e, uint64_t id) {
    pthread_mutex_lock(&g_mu);
    batch_t *b = live_batch(id);
    pthread_mutex_unlock(&g_mu);
    return b && b->e == e ? b : NULL;
}

int submitTransfer(void *engine, uint64_t batch_id, struct transfer_request *reqs, size_t n) {
    engine_t *e = engine;
    batch_t *b = engine_batch(e, batch_id);
    if (!b) return S_INVALID;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (!e->proto[0])
        rc = S_NO_TRANSPORT;
    else if (b->n + n > b->cap)
        rc = S_TOO_MANY;
    for (size_t i = 0; i < n && !rc; i++) {
        struct transfer_request *r = &reqs[i];
        if (r->opcode != 1 || r->target_id < 1 || r->target_id > e->nsegs)
            rc = S_INVALID;
        else if (!inside_regs(e, (uintptr_t)r->source, r->length))
            rc = S_NOT_REGISTERED;
    }
    if (!rc) {
        for (size_t i = 0; i < n; i++) {
            task_t *t = &b->tasks[b->n++];
            *t = (task_t){b, reqs[i].source, reqs[i].target_id, reqs[i].target_offset, reqs[i].length, STATUS_WAITING, 0, NULL};
            if (e->qtail)
                e->qtail->next = t;
            else
                e->qhead = t;
            e->qtail = t;
        }
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    if (!rc) count(&g_stats.tasks_submitted, (int64_t)n);
    return rc;
}

int getTransferStatus(void *engine, uint64_t batch_id, size_t task_id, struct transfer_status *out) {
    engine_t *e = engine;
    batch_t *b = engine_batch(e, batch_id);
    if (!b) return S_INVALID;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (task_id >= b->n) {
        rc = S_INVALID;
    } else {
        out->status = b->tasks[task_id].status;
        out->transferred_bytes = b->tasks[task_id].done;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

#ifndef MCD_OMIT_FREEBATCHID
int freeBatchID(void *engine, uint64_t batch_id) {
    engine_t *e = engine;
    pthread_mutex_lock(&g_mu);
    batch_t *b = live_batch(batch_id);
    if (!b || b->e != e) {
        pthread_mutex_unlock(&g_mu);
        return S_INVALID;
    }
    pthread_mutex_lock(&e->mu);
    int busy = 0;
    for (size_t i = 0; i < b->n; i++)
        if (b->tasks[i].status == STATUS_WAITING || b->tasks[i].status == STATUS_PENDING) busy = 1;
    pthread_mutex_unlock(&e->mu);
    if (busy) {
        g_stats.busy_frees++;
        pthread_mutex_unlock(&g_mu);
        return S_BUSY;
    }
    for (batch_t **p = &g_batches; *p; p = &(*p)->next) {
        if (*p == b) {
            *p = b->next;
            break;
        }
    }
    g_stats.batches_live--;
    g_stats.batches_freed++;
    pthread_mutex_unlock(&g_mu);
    b->magic = 0;
    free(b->tasks);
    free(b);
    return 0;
}
#endif

/* ---- fault injection and counters --------------------------------------- */

static engine_t *by_name(const char *name) {
    for (engine_t *e = g_engines; e; e = e->next)
        if (strcmp(e->name, name) == 0) return e;
    return NULL;
}

/* The next n tasks of any engine end FAILED without being sent. */
void mcd_fail_next(int n) {
    pthread_mutex_lock(&g_mu);
    g_fail_next = n;
    pthread_mutex_unlock(&g_mu);
}

/* The engine serving segment delays every incoming write by us. */
int mcd_set_delay_us(const char *segment, int us) {
    pthread_mutex_lock(&g_mu);
    engine_t *e = by_name(segment);
    if (e) {
        pthread_mutex_lock(&e->mu);
        e->delay_us = us;
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_unlock(&g_mu);
    return e ? 0 : -1;
}

/* With on, the engine serving segment leaves every incoming write unread,
 * and so its task unfinished, until it is called again with 0, killed or
 * destroyed: a test decides when a write lands instead of racing a delay. */
int mcd_hold(const char *segment, int on) {
    pthread_mutex_lock(&g_mu);
    engine_t *e = by_name(segment);
    if (e) {
        pthread_mutex_lock(&e->mu);
        e->held = on;
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_unlock(&g_mu);
    return e ? 0 : -1;
}

/* The engine serving segment vanishes as if its process died: its listener
 * and connections close. Its API stays usable so that its owner can still
 * destroy it. */
int mcd_kill(const char *segment) {
    pthread_mutex_lock(&g_mu);
    engine_t *e = by_name(segment);
    if (e) stop_serving(e);
    pthread_mutex_unlock(&g_mu);
    return e ? 0 : -1;
}

void mcd_stats(struct mcd_stats *out) {
    pthread_mutex_lock(&g_mu);
    *out = g_stats;
    pthread_mutex_unlock(&g_mu);
}

/* The baseline of the transport's benchmark: n writes of item bytes from
 * src + i*item to remote + i*item as one batch, polled in a tight loop and
 * freed, with no staging and no language boundary. Returns 0 or the first
 * error. */
int mcd_raw_write(void *engine, void *src, int32_t seg, uint64_t remote, uint64_t item, size_t n) {
    uint64_t b = allocateBatchID(engine, n);
    struct transfer_request *reqs = calloc(n, sizeof *reqs);
    for (size_t i = 0; i < n; i++) reqs[i] = (struct transfer_request){1, (char *)src + i * item, seg, 0, remote + i * item, item};
    int rc = submitTransfer(engine, b, reqs, n);
    free(reqs);
    for (size_t i = 0; i < n && rc == 0; i++) {
        struct transfer_status st = {0, 0};
        for (;;) {
            if (getTransferStatus(engine, b, i, &st) != 0) {
                rc = S_INVALID;
                break;
            }
            if (st.status >= STATUS_COMPLETED || st.status == STATUS_INVALID || st.status == STATUS_CANCELED) break;
            sched_yield();
        }
        if (rc == 0 && st.status != STATUS_COMPLETED) rc = 1000 + st.status;
    }
#ifndef MCD_OMIT_FREEBATCHID
    while (freeBatchID(engine, b) == S_BUSY) sched_yield();
#endif
    return rc;
}

# Declarations only: the parts of liburing 2.3 (and the kernel uapi it includes) that _uring.pyx uses.
# Structs list just the fields we touch (Cython needs no more: the C compiler sees the real header).

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t


cdef extern from "<linux/time_types.h>" nogil:
    struct __kernel_timespec:
        long long tv_sec
        long long tv_nsec


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len


cdef extern from "<liburing.h>" nogil:
    struct io_uring_sqe:
        uint8_t opcode
        uint16_t buf_index  # (in a union with buf_group)

    struct io_uring_probe:
        pass

    struct io_uring_cqe:
        uint64_t user_data
        int32_t res
        uint32_t flags

    struct io_uring_params:
        uint32_t sq_entries
        uint32_t cq_entries
        uint32_t flags
        uint32_t features

    struct io_uring:
        int ring_fd
        unsigned features

    enum:
        IORING_SETUP_CQSIZE
        IORING_SETUP_CLAMP
        IORING_SETUP_COOP_TASKRUN
        IORING_SETUP_TASKRUN_FLAG
        IORING_FEAT_NODROP
        IORING_FEAT_EXT_ARG
        IORING_ASYNC_CANCEL_ANY
        IOSQE_ASYNC

    uint64_t LIBURING_UDATA_TIMEOUT

    int io_uring_queue_init_params(unsigned entries, io_uring *ring, io_uring_params *p)
    void io_uring_queue_exit(io_uring *ring)

    io_uring_sqe *io_uring_get_sqe(io_uring *ring)
    unsigned io_uring_sq_ready(const io_uring *ring)
    int io_uring_submit(io_uring *ring)

    void io_uring_prep_read(io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, uint64_t offset)
    void io_uring_prep_write(io_uring_sqe *sqe, int fd, const void *buf, unsigned nbytes, uint64_t offset)
    void io_uring_prep_readv(io_uring_sqe *sqe, int fd, const iovec *iovecs, unsigned nr_vecs, uint64_t offset)
    void io_uring_prep_writev(io_uring_sqe *sqe, int fd, const iovec *iovecs, unsigned nr_vecs, uint64_t offset)
    void io_uring_prep_read_fixed(io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, uint64_t offset,
                                  int buf_index)
    void io_uring_prep_cancel64(io_uring_sqe *sqe, uint64_t user_data, int flags)
    void io_uring_sqe_set_data64(io_uring_sqe *sqe, uint64_t data)
    void io_uring_sqe_set_flags(io_uring_sqe *sqe, unsigned flags)

    io_uring_probe *io_uring_get_probe_ring(io_uring *ring)
    void io_uring_free_probe(io_uring_probe *probe)
    int io_uring_opcode_supported(const io_uring_probe *p, int op)
    int io_uring_register_buffers_sparse(io_uring *ring, unsigned nr)
    int io_uring_register_buffers_update_tag(io_uring *ring, unsigned off, const iovec *iovecs,
                                             const unsigned long long *tags, unsigned nr)
    int io_uring_unregister_buffers(io_uring *ring)

    int io_uring_wait_cqes(io_uring *ring, io_uring_cqe **cqe_ptr, unsigned wait_nr,
                           __kernel_timespec *ts, void *sigmask)
    unsigned io_uring_peek_batch_cqe(io_uring *ring, io_uring_cqe **cqes, unsigned count)
    void io_uring_cq_advance(io_uring *ring, unsigned nr)
    uint64_t io_uring_cqe_get_data64(const io_uring_cqe *cqe)

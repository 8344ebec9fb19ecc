/*
 * The stand-ins for rdma-core's provider libraries on a vRDMA device:
 * compiled against rdma-core's headers, linked against vRDMA's
 * libibverbs.so.1 and the companion library under each of its sonames,
 * and run against a daemon (tests/stand_ins.rs).
 *
 * Every direct-verbs function must answer "not supported" as rdma-core's
 * do for a device of another vendor: false from mlx5dv_is_supported,
 * NULL with errno EOPNOTSUPP from constructors, EOPNOTSUPP from int
 * functions (-EOPNOTSUPP, -1 where the function returns a count or a
 * descriptor), nothing from void ones. None may read its arguments
 * (POISON would fault), and none may claim the device: the device list
 * is vRDMA's before and after, and the device keeps working.
 *
 * Prints "companions_check: OK" and exits 0 when every check passes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/mlx4dv.h>
#include <infiniband/efadv.h>
#include <infiniband/manadv.h>

static int failures;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		if (!(cond)) {                                                 \
			fprintf(stderr, "FAIL line %d: %s: ", __LINE__,       \
				#cond);                                        \
			fprintf(stderr, __VA_ARGS__);                          \
			fprintf(stderr, "\n");                                 \
			failures++;                                            \
		}                                                              \
	} while (0)

/* An address no function may read: the stand-ins ignore their arguments. */
#define POISON ((void *)16)

/* A NULL answer with errno EOPNOTSUPP, errno cleared before the call. */
#define CHECK_NULL(call)                                                       \
	do {                                                                   \
		errno = 0;                                                     \
		void *p_ = (void *)(call);                                     \
		int e_ = errno;                                                \
		CHECK(p_ == NULL && e_ == EOPNOTSUPP, "%p, errno %d", p_,     \
		      e_);                                                     \
	} while (0)

/* An int answer `want` with errno EOPNOTSUPP. */
#define CHECK_INT(call, want)                                                  \
	do {                                                                   \
		errno = 0;                                                     \
		long r_ = (long)(call);                                        \
		int e_ = errno;                                                \
		CHECK(r_ == (want) && e_ == EOPNOTSUPP, "%ld, errno %d", r_,  \
		      e_);                                                     \
	} while (0)

static int vrdma_devices(void)
{
	int n = -1;
	struct ibv_device **list = ibv_get_device_list(&n);

	CHECK(list != NULL, "ibv_get_device_list: errno %d", errno);
	if (!list)
		return -1;
	for (int i = 0; i < n; i++)
		CHECK(strncmp(ibv_get_device_name(list[i]), "vrdma", 5) == 0,
		      "a device not vRDMA's: %s", ibv_get_device_name(list[i]));
	ibv_free_device_list(list);
	return n;
}

static void mlx5(struct ibv_device *dev, struct ibv_context *ctx,
		 struct ibv_pd *pd, struct ibv_cq *cq, struct ibv_qp *qp)
{
	CHECK(!mlx5dv_is_supported(dev), "mlx5dv_is_supported");
	CHECK_NULL(mlx5dv_open_device(dev, NULL));

	struct mlx5dv_context attrs;
	memset(&attrs, 0xa5, sizeof(attrs));
	CHECK_INT(mlx5dv_query_device(ctx, &attrs), EOPNOTSUPP);
	CHECK(attrs.comp_mask == 0xa5a5a5a5a5a5a5a5ull,
	      "mlx5dv_query_device wrote its answer");

	struct mlx5dv_qp dv_qp;
	struct mlx5dv_cq dv_cq;
	struct mlx5dv_obj obj = { .qp = { .in = qp, .out = &dv_qp },
				  .cq = { .in = cq, .out = &dv_cq } };
	CHECK_INT(mlx5dv_init_obj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ),
		  EOPNOTSUPP);

	struct ibv_qp_init_attr_ex qp_attr = {
		.qp_type = IBV_QPT_RC,
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4,
			 .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD,
		.pd = pd,
	};
	struct mlx5dv_qp_init_attr dv_qp_attr = { 0 };
	CHECK_NULL(mlx5dv_create_qp(ctx, &qp_attr, &dv_qp_attr));
	struct ibv_cq_init_attr_ex cq_attr = { .cqe = 4 };
	CHECK_NULL(mlx5dv_create_cq(ctx, &cq_attr, NULL));
	CHECK_NULL(mlx5dv_create_cq(POISON, POISON, POISON));

	uint32_t in[16] = { 0 }, out[16];
	CHECK_INT(mlx5dv_devx_general_cmd(ctx, in, sizeof(in), out,
					  sizeof(out)), EOPNOTSUPP);
	CHECK_NULL(mlx5dv_devx_obj_create(ctx, in, sizeof(in), out,
					  sizeof(out)));
	CHECK_INT(mlx5dv_devx_obj_destroy(POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_devx_qp_query(qp, in, sizeof(in), out, sizeof(out)),
		  EOPNOTSUPP);
	CHECK_NULL(mlx5dv_devx_alloc_uar(ctx, 0));
	CHECK_NULL(mlx5dv_devx_umem_reg(ctx, out, sizeof(out), 0));
	CHECK_NULL(mlx5dv_devx_create_event_channel(ctx, 0));
	CHECK_INT(mlx5dv_devx_get_event(POISON, POISON, 64), -1);
	uint16_t events[2] = { 1, 2 };
	CHECK_INT(mlx5dv_devx_subscribe_devx_event(POISON, POISON,
						   sizeof(events), events, 7),
		  EOPNOTSUPP);
	CHECK_INT(mlx5dv_devx_obj_query_async(POISON, in, sizeof(in),
					      sizeof(out), 1, POISON),
		  EOPNOTSUPP);
	CHECK_INT(mlx5dv_qp_cancel_posted_send_wrs(POISON, 1), -EOPNOTSUPP);
	CHECK_INT(mlx5dv_vfio_get_events_fd(ctx), -1);
	CHECK_INT(mlx5dv_vfio_process_events(ctx), EOPNOTSUPP);
	CHECK_NULL(mlx5dv_get_vfio_device_list(POISON));
	CHECK_NULL(mlx5dv_qp_ex_from_ibv_qp_ex(POISON));

	struct mlx5dv_mkey_init_attr mkey_attr = { .pd = pd };
	CHECK_NULL(mlx5dv_create_mkey(&mkey_attr));
	CHECK_INT(mlx5dv_destroy_mkey(POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_crypto_login(ctx, POISON), EOPNOTSUPP);
	CHECK_NULL(mlx5dv_dek_create(ctx, POISON));
	CHECK_INT(mlx5dv_dek_destroy(POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_set_context_attr(ctx, MLX5DV_CTX_ATTR_BUF_ALLOCATORS,
					  POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_get_clock_info(ctx, POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_reserved_qpn_alloc(ctx, POISON), EOPNOTSUPP);

	CHECK_NULL(mlx5dv_dr_domain_create(ctx, MLX5DV_DR_DOMAIN_TYPE_NIC_RX));
	CHECK_NULL(mlx5dv_dr_action_create_drop());
	CHECK_NULL(mlx5dv_dr_action_create_tag(7));
	CHECK_INT(mlx5dv_dr_domain_destroy(POISON), EOPNOTSUPP);
	CHECK_INT(mlx5dv_dump_dr_domain(stderr, POISON), EOPNOTSUPP);

	/* void: nothing, and no fault. */
	mlx5dv_devx_free_uar(POISON);
	mlx5dv_devx_destroy_event_channel(POISON);
	mlx5dv_devx_destroy_cmd_comp(POISON);
	mlx5dv_pp_free(POISON);
	mlx5dv_free_var(POISON);
	mlx5dv_dr_domain_allow_duplicate_rules(POISON, true);
	mlx5dv_dr_domain_set_reclaim_device_memory(POISON, true);
}

static void mlx4(struct ibv_context *ctx, struct ibv_pd *pd,
		 struct ibv_cq *cq, struct ibv_qp *qp)
{
	struct mlx4dv_context attrs;
	memset(&attrs, 0xa5, sizeof(attrs));
	CHECK_INT(mlx4dv_query_device(ctx, &attrs), EOPNOTSUPP);
	CHECK(attrs.comp_mask == 0xa5a5a5a5a5a5a5a5ull,
	      "mlx4dv_query_device wrote its answer");
	struct mlx4dv_qp dv_qp;
	struct mlx4dv_obj obj = { .qp = { .in = qp, .out = &dv_qp } };
	CHECK_INT(mlx4dv_init_obj(&obj, MLX4DV_OBJ_QP), EOPNOTSUPP);
	uint8_t log_range = 3;
	CHECK_INT(mlx4dv_set_context_attr(ctx,
					  MLX4DV_SET_CTX_ATTR_LOG_WQS_RANGE_SZ,
					  &log_range), EOPNOTSUPP);
	struct ibv_qp_init_attr_ex qp_attr = {
		.qp_type = IBV_QPT_RC, .send_cq = cq, .recv_cq = cq,
		.cap = { .max_send_wr = 1, .max_recv_wr = 1,
			 .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pd,
	};
	CHECK_NULL(mlx4dv_create_qp(ctx, &qp_attr, POISON));
}

static void efa(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_cq *cq)
{
	struct efadv_device_attr attrs;
	memset(&attrs, 0xa5, sizeof(attrs));
	CHECK_INT(efadv_query_device(ctx, &attrs, sizeof(attrs)), EOPNOTSUPP);
	CHECK(attrs.comp_mask == 0xa5a5a5a5a5a5a5a5ull,
	      "efadv_query_device wrote its answer");
	struct ibv_qp_init_attr_ex qp_attr = {
		.qp_type = IBV_QPT_DRIVER, .send_cq = cq, .recv_cq = cq,
		.comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pd,
	};
	struct efadv_qp_init_attr efa_qp = { .driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD };
	CHECK_NULL(efadv_create_qp_ex(ctx, &qp_attr, &efa_qp, sizeof(efa_qp)));
	struct ibv_qp_init_attr old_attr = { .qp_type = IBV_QPT_DRIVER,
					     .send_cq = cq, .recv_cq = cq };
	CHECK_NULL(efadv_create_driver_qp(pd, &old_attr, EFADV_QP_DRIVER_TYPE_SRD));
	struct ibv_cq_init_attr_ex cq_attr = { .cqe = 4 };
	struct efadv_cq_init_attr efa_cq = { 0 };
	CHECK_NULL(efadv_create_cq(ctx, &cq_attr, &efa_cq, sizeof(efa_cq)));
	CHECK_NULL(efadv_cq_from_ibv_cq_ex(POISON));
	struct efadv_ah_attr ah_attr;
	CHECK_INT(efadv_query_ah(POISON, &ah_attr, sizeof(ah_attr)), EOPNOTSUPP);
}

static void mana(struct ibv_context *ctx, struct ibv_qp *qp)
{
	struct manadv_qp dv_qp;
	struct manadv_obj obj = { .qp = { .in = qp, .out = &dv_qp } };
	CHECK_INT(manadv_init_obj(&obj, MANADV_OBJ_QP), EOPNOTSUPP);
	struct manadv_ctx_allocators alloc = { 0 };
	CHECK_INT(manadv_set_context_attr(ctx, MANADV_CTX_ATTR_BUF_ALLOCATORS,
					  &alloc), EOPNOTSUPP);
}

/* Each library's nodes, looked up by soname and version as a program linked
 * against rdma-core's binds them: the older mlx5dv_init_obj too. */
static void versions(void)
{
	static const struct {
		const char *soname, *name, *version;
	} syms[] = {
		{ "libmlx5.so.1", "mlx5dv_init_obj", "MLX5_1.0" },
		{ "libmlx5.so.1", "mlx5dv_init_obj", "MLX5_1.2" },
		{ "libmlx5.so.1", "mlx5dv_query_device", "MLX5_1.0" },
		{ "libmlx5.so.1", "mlx5dv_crypto_login", "MLX5_1.21" },
		{ "libmlx5.so.1", "mlx5dv_get_data_direct_sysfs_path", NULL },
		{ "libmlx4.so.1", "mlx4dv_query_device", "MLX4_1.0" },
		{ "libefa.so.1", "efadv_query_device", "EFA_1.1" },
		{ "libmana.so.1", "manadv_init_obj", "MANA_1.0" },
	};
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *lib = dlopen(syms[i].soname, RTLD_NOW | RTLD_NOLOAD);
		CHECK(lib != NULL, "%s is not loaded: %s", syms[i].soname,
		      dlerror());
		if (!lib)
			continue;
		if (!syms[i].version) {
			/* rdma-core 44 has no such function: neither do we. */
			CHECK(dlsym(lib, syms[i].name) == NULL, "%s",
			      syms[i].name);
		} else {
			int (*f)(void *, uint64_t) =
				(int (*)(void *, uint64_t))dlvsym(
					lib, syms[i].name, syms[i].version);
			CHECK(f != NULL, "%s@%s in %s", syms[i].name,
			      syms[i].version, syms[i].soname);
			if (f)
				CHECK_INT(f(POISON, 0), EOPNOTSUPP);
		}
		dlclose(lib);
	}
}

int main(void)
{
	int before = vrdma_devices();
	CHECK(before >= 1, "%d devices", before);
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0]) {
		fprintf(stderr, "no device\n");
		return 1;
	}
	struct ibv_device *dev = list[0];
	struct ibv_context *ctx = ibv_open_device(dev);
	CHECK(ctx != NULL, "ibv_open_device: errno %d", errno);
	struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	struct ibv_cq *cq = ctx ? ibv_create_cq(ctx, 8, NULL, NULL, 0) : NULL;
	struct ibv_qp_init_attr qp_attr = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4,
			 .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = pd ? ibv_create_qp(pd, &qp_attr) : NULL;
	if (!pd || !cq || !qp) {
		fprintf(stderr, "FAIL: vRDMA objects: errno %d\n", errno);
		return 1;
	}

	mlx5(dev, ctx, pd, cq, qp);
	mlx4(ctx, pd, cq, qp);
	efa(ctx, pd, cq);
	mana(ctx, qp);
	versions();

	/* The device is still vRDMA's, and still works. */
	struct ibv_device_attr attr;
	CHECK(ibv_query_device(ctx, &attr) == 0, "ibv_query_device");
	struct ibv_qp_attr init = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	CHECK(ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
				       IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0,
	      "ibv_modify_qp to INIT: errno %d", errno);
	CHECK(ibv_destroy_qp(qp) == 0, "ibv_destroy_qp");
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	ibv_free_device_list(list);
	CHECK(vrdma_devices() == before, "the device list changed");

	if (failures) {
		fprintf(stderr, "companions_check: %d failures\n", failures);
		return 1;
	}
	printf("companions_check: OK\n");
	return 0;
}
